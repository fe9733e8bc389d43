"""How a run's steps to a target respond to what each step generates and trains (issue 39 item 1).

    python benchmarks/response_model.py --runs            # the regime-matrix arms below, 3 seeds, every cell
    python benchmarks/response_model.py --noise           # the noise terms at each cell's start (lr 0)
    python benchmarks/response_model.py                   # the table from what exists (both phases must have run)
    python benchmarks/response_model.py --cells long,long_epochs --runs --noise

**Measured response.** In each cell of the regime matrix (`regime_matrix.py`: its cells, seeds and protocol; every
arm given the same seed's GRPO compute), the steps to each target (start + 50%, 80%, 95% of GRPO's mean gain,
`prompt_analysis.analyse`) of GRPO on a fraction φ = 0.5 and 0.25 of each generation batch's prompts
(`cost_aware_prompt_fraction`, arms `grpo_p0.5`, `grpo_p0.25`) and of the row stage at kept 0.5 and 0.25
(`cost_aware_0.5`, `cost_aware_0.25`), over the same seed's GRPO run's: a paired ratio per seed, mean and bootstrap
interval over seeds.

**Noise at the start.** At the cell's start with the learning rate at 0 (the parameters do not move, so consecutive
optimizer steps' gradients G_t are independent draws at one point), `--noise-steps` generation batches of each batch
`NOISE_CONFIGS` names, the gradients read before clipping: signal |𝐆|² = mean G_t·G_{t−1}, noise = mean |G_t|² −
signal, ρ = noise / signal of the full batch, and each batch's noise multiplier m = its noise / the full batch's. The
model's m for a prompt fraction is 1/φ; for a row sample it is 1 + I, with I the sampler's predicted variance inflation
(`budget.variance_inflation`, rows taken as independent; the trainer logs it as ``cost_aware/budget_inflation``).

**Candidate models** (`MODELS`), steps(batch) / steps(full) from ρ and m:

- ``sgd``: the critical-batch model of McCandlish et al. 2018 (arXiv 1812.06162) for SGD at a tuned learning rate,
  (1 + ρ m) / (1 + ρ);
- ``adam``: Adam (or any sign-like, per-coordinate-normalised update) at a fixed learning rate. Its step has a fixed
  size whatever the noise, so the noise costs no curvature penalty; it only tilts the direction. With
  v ≈ 𝐆² + σ²/B per coordinate, the expected descent per step is ∝ Σᵢ 𝐆ᵢ² / √(𝐆ᵢ² + σᵢ²/B), and with a common
  signal-to-noise ratio across coordinates that is ∝ 1 / √(1 + ρ): steps(batch) / steps(full) =
  √((1 + ρ m) / (1 + ρ)). No constant is fitted.
- ``adam_coord``: ``adam`` without the common signal-to-noise ratio: steps(m) / steps(1) = P(1) / P(m),
  P(m) = Σᵢ 𝐆ᵢ² / √(𝐆ᵢ² + m σᵢ²), from each coordinate's gradient mean and variance over the lr-0 steps (the
  preconditioned geometry: Adam's v̂ ≈ 𝐆ᵢ² + σᵢ² per coordinate).
- ``adam_run``: ``adam`` with ρ as the run estimates it while training (GRPO with the rule measuring but never
  cutting, arm ``grpo_pmeasure``: the mean of its first 10 logged ``cost_aware/prompt_noise_to_signal``), the ρ the
  ``"auto"`` rule acts on.
- ``sgd_cross``: ``sgd`` with ρ scaled by a factor fitted on the other testbed's cells (least squares on their measured
  ratios; fit on `default*`, scored on `long*`, and the reverse): a calibration scored on cells it was not fitted on.

Each model is scored with m as the model states it (1/φ, 1 + I) and with m measured at lr 0. A prediction "holds" when
it is within ±15% of the measured mean ratio (|predicted / measured − 1| ≤ 0.15).

Results: `benchmarks/results/response_model.{json,md}`; runs under `outputs/bench/response_model/` (the regime
matrix's layout, so `regime_matrix.py --analyze-only --out outputs/bench/response_model` reads them too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
from regime_runs import CELLS  # noqa: E402

DEFAULT_CELLS = ("default", "default_variance", "long", "long_variance", "long_epochs")
RESPONSE_ARMS = ("grpo", "grpo_p0.5", "grpo_p0.25", "cost_aware_0.5", "cost_aware_0.25")
NONE = {"cost_aware_weight_normalization": "none"}
# The batches whose noise is measured at lr 0, and the arm whose measured response each one predicts.
NOISE_CONFIGS = {
    "full": ({"cost_aware": False}, "grpo"),
    "prompts_0.5": ({"cost_aware": False, "cost_aware_prompt_fraction": 0.5}, "grpo_p0.5"),
    "prompts_0.25": ({"cost_aware": False, "cost_aware_prompt_fraction": 0.25}, "grpo_p0.25"),
    "kept_0.5": ({"cost_aware": True, "cost_aware_kept_fraction": 0.5, **NONE}, "cost_aware_0.5"),
    "kept_0.25": ({"cost_aware": True, "cost_aware_kept_fraction": 0.25, **NONE}, "cost_aware_0.25"),
}
TARGETS = (0.5, 0.8, 0.95)
TOLERANCE = 0.15


def sgd_model(rho: float, m: float) -> float:
    """(1 + ρ m) / (1 + ρ): steps at a batch with noise multiplier m over the full batch's, SGD (module docstring);
    1/m's limit m when ρ is ∞."""
    return m if math.isinf(rho) else (1.0 + rho * m) / (1.0 + rho)


def adam_model(rho: float, m: float) -> float:
    """√((1 + ρ m) / (1 + ρ)): the same under a fixed-size, per-coordinate-normalised step (module docstring)."""
    return math.sqrt(sgd_model(rho, m))


MODELS = {"sgd": sgd_model, "adam": adam_model}


# ============================================================================================ the noise at lr 0
def measure_noise(ctx: dict, config: str, out_root: str, steps: int, seed: int = 0) -> dict:
    """Signal, noise and mean predicted inflation of one batch of `NOISE_CONFIGS` at the cell's start, lr 0
    (module docstring); cached in ``out_root/noise_<cell>_<config>.json``."""
    path = os.path.join(out_root, f"noise_{ctx['cell']}_{config}.json")
    coords = coordinates_path(out_root, ctx["cell"]) if config == "full" else None
    key = {"steps": steps, "seed": seed, "extra": ctx["extra"], "model_path": ctx["model_path"], "pool": ctx["pool"]}
    if os.path.exists(path) and (coords is None or os.path.exists(coords)):
        with open(path, encoding="utf-8") as fh:
            cached = json.load(fh)
        if cached.get("key") == key:
            return cached
    import torch

    from trl_costaware import CostAwareGRPOTrainer
    from trl_costaware.embedded.testbed import train_run

    grads = []

    class Reading(CostAwareGRPOTrainer):
        def _clip_grad_norm(self, model):
            grads.append(
                torch.cat([p.grad.detach().flatten().double() for p in model.parameters() if p.grad is not None])
            )
            return super()._clip_grad_norm(model)

    settings = {
        **ctx["extra"],
        **NOISE_CONFIGS[config][0],
        "learning_rate": 0.0,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
    }
    out = os.path.join(out_root, f"noise_{ctx['cell']}_{config}")
    metrics = os.path.join(out, "cost_aware_metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    train_run(
        seed=seed,
        output_dir=out,
        steps=steps,
        settings=settings,
        trainer_cls=Reading,
        eval_every=10**6,
        eval_n=32,
        model_path=ctx["model_path"],
        testbed=ctx["testbed"],
        pool=ctx["pool"],
    )
    with open(metrics, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    inflation = [r["cost_aware/budget_inflation"] for r in rows if "cost_aware/budget_inflation" in r]
    g = torch.stack(grads)
    if coords is not None:  # per coordinate: the mean and variance of the full batch's gradient over the steps
        np.savez(coords, mean=g.mean(0).numpy(), var=g.var(0, unbiased=True).numpy(), n=len(g))
    sq = np.array([float(g[i] @ g[i]) for i in range(1, len(g))])
    dot = np.array([float(g[i] @ g[i - 1]) for i in range(1, len(g))])
    res = {
        "key": key,
        "cell": ctx["cell"],
        "config": config,
        "pairs": int(len(sq)),
        "sq": sq.tolist(),
        "dot": dot.tolist(),
        "signal": float(dot.mean()),
        "noise": float(sq.mean() - dot.mean()),
        "inflation": float(np.mean(inflation)) if inflation else 0.0,
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(res, fh)
    return res


def coordinates_path(out_root: str, cell: str) -> str:
    return os.path.join(out_root, f"noise_{cell}_full_coordinates.npz")


def adam_coordinate_model(mean: np.ndarray, var: np.ndarray, n: int, m: float) -> float:
    """The ``adam`` model without its common-signal-to-noise assumption: steps(m) / steps(1) =
    P(1) / P(m), P(m) = Σᵢ 𝐆ᵢ² / √(𝐆ᵢ² + m σᵢ²), from the full batch's per-coordinate gradient mean and variance
    over `n` independent steps at lr 0 (𝐆ᵢ² = max(meanᵢ² − varᵢ / n, 0), its unbiased estimate clipped at 0;
    σᵢ² = varᵢ)."""
    g2 = np.maximum(mean.astype(np.float64) ** 2 - var / n, 0.0)
    s2 = var.astype(np.float64)

    def progress(mult):
        den = np.sqrt(g2 + mult * s2)
        return float(np.sum(np.divide(g2, den, out=np.zeros_like(g2), where=den > 0)))

    p1, pm = progress(1.0), progress(m)
    return p1 / pm if pm > 0 else math.inf


def noise_summary(measured: dict[str, dict], resamples: int = 2000) -> dict:
    """ρ of the full batch and each batch's multiplier m (point and bootstrap interval over the steps, resampled
    jointly across batches by step index), and the model's m."""
    full = measured["full"]
    n = min(len(v["sq"]) for v in measured.values())
    rng = np.random.default_rng(0)
    idx = rng.integers(0, n, size=(resamples, n))

    def parts(v, i):
        sq, dot = np.asarray(v["sq"][:n])[i], np.asarray(v["dot"][:n])[i]
        return sq.mean(-1) - dot.mean(-1), dot.mean(-1)

    noise_f, signal_f = parts(full, idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho_boot = np.where(signal_f > 0, noise_f / signal_f, np.inf)
    rho = full["noise"] / full["signal"] if full["signal"] > 0 else math.inf
    out = {
        "rho": rho,
        "rho_ci": [float(q) for q in np.quantile(rho_boot, [0.025, 0.975], method="nearest")],
        "signal": full["signal"],
        "noise": full["noise"],
        "configs": {},
    }
    for name, v in measured.items():
        noise_c, _ = parts(v, idx)
        m_boot = noise_c / noise_f
        theory = 1.0
        fraction = NOISE_CONFIGS[name][0].get("cost_aware_prompt_fraction")
        if fraction is not None:
            theory = 1.0 / float(fraction)
        elif NOISE_CONFIGS[name][0].get("cost_aware"):
            theory = 1.0 + v["inflation"]
        out["configs"][name] = {
            "m_measured": v["noise"] / full["noise"],
            "m_measured_ci": [float(q) for q in np.quantile(m_boot, [0.025, 0.975])],
            "m_model": theory,
            "inflation": v["inflation"],
        }
    return out


# ==================================================================================================== the table
def measured_ratios(cell_root: str) -> dict:
    """Per arm and target: the paired steps-to-target ratio against GRPO (mean, low, high), seeds reaching it."""
    from prompt_analysis import analyse

    res = analyse(cell_root)
    if res.get("status") != "run":
        return {}
    out = {"targets": res["targets"], "grpo_gain": res["grpo_gain"], "arms": {}}
    for arm, a in res["arms"].items():
        out["arms"][arm] = {
            str(f): {"ratio": a[f"ratio_step_{f}"], "reached": a[f"reached_{f}"], "n": a["n"]} for f in TARGETS
        }
    return out


RUN_RHO_ARM = "grpo_pmeasure"
RUN_RHO_BATCHES = 10  # the run's own first estimates: its first this many generation batches with a prediction


def run_rho(cell_root: str) -> dict | None:
    """ρ as the run itself estimates it, during GRPO training (lr > 0, the rule on but never cutting: arm
    `RUN_RHO_ARM`): per seed, the mean of ``cost_aware/prompt_noise_to_signal`` over the first `RUN_RHO_BATCHES`
    generation batches that logged it; mean and bootstrap interval over seeds. None without such runs."""
    from regime_runs import read_metrics

    per_seed = []
    for name in sorted(os.listdir(cell_root)) if os.path.isdir(cell_root) else []:
        if not name.startswith(f"{RUN_RHO_ARM}__s"):
            continue
        vals = [
            r["cost_aware/prompt_noise_to_signal"]
            for r in read_metrics(os.path.join(cell_root, name))
            if isinstance(r.get("cost_aware/prompt_noise_to_signal"), (int, float))
        ][:RUN_RHO_BATCHES]
        vals = [v for v in vals if math.isfinite(v)]
        if vals:
            per_seed.append(float(np.mean(vals)))
    if not per_seed:
        return None
    from token_efficiency import bootstrap_ci

    return {"rho": bootstrap_ci(per_seed), "seeds": len(per_seed)}


def cross_factor(rows: list[dict], fit_cells: set[str]) -> float | None:
    """The factor k minimising Σ (sgd(k ρ, m) − measured)² over the rows of `fit_cells` (a grid search)."""
    pts = [
        (r["rho"], r["m_model"], r["measured"][0])
        for r in rows
        if r["cell"] in fit_cells and r["measured"][0] is not None and math.isfinite(r["rho"])
    ]
    if not pts:
        return None
    grid = np.exp(np.linspace(math.log(0.01), math.log(10.0), 2001))
    err = [sum((sgd_model(k * rho, m) - y) ** 2 for rho, m, y in pts) for k in grid]
    return float(grid[int(np.argmin(err))])


def build_table(cells: list[str], root: str, noise_root: str) -> dict:
    rows = []
    summaries = {}
    for cell in cells:
        rec_path = os.path.join(root, "cells", f"{cell}.json")
        if not os.path.exists(rec_path):
            continue
        with open(rec_path, encoding="utf-8") as fh:
            rec = json.load(fh)
        measured = {}
        for config in NOISE_CONFIGS:
            path = os.path.join(noise_root, f"noise_{cell}_{config}.json")
            if os.path.exists(path):
                with open(path, encoding="utf-8") as fh:
                    measured[config] = json.load(fh)
        if "full" not in measured or rec.get("runs") is None:
            continue
        summary = noise_summary(measured)
        summaries[cell] = summary
        coords = coordinates_path(noise_root, cell)
        coords = dict(np.load(coords)) if os.path.exists(coords) else None
        response = measured_ratios(rec["runs"])
        in_run = run_rho(rec["runs"])
        summary["rho_run"] = in_run
        for config, (_, arm) in NOISE_CONFIGS.items():
            if config == "full" or config not in summary["configs"]:
                continue
            c = summary["configs"][config]
            for f in TARGETS:
                m_arm = (response.get("arms") or {}).get(arm, {}).get(str(f))
                measured_ratio = m_arm["ratio"] if m_arm else (None, None, None)
                row = {
                    "cell": cell,
                    "arm": arm,
                    "config": config,
                    "target": f,
                    "rho": summary["rho"],
                    "m_model": c["m_model"],
                    "m_measured": c["m_measured"],
                    "measured": list(measured_ratio),
                    "reached": None if not m_arm else f"{m_arm['reached']}/{m_arm['n']}",
                }
                for name, fn in MODELS.items():
                    row[f"{name}_model_m"] = fn(summary["rho"], c["m_model"])
                    row[f"{name}_measured_m"] = fn(summary["rho"], max(c["m_measured"], 0.0))
                rho_run = None if in_run is None else in_run["rho"][0]
                row["adam_run_model_m"] = None if rho_run is None else adam_model(rho_run, c["m_model"])
                for label, mult in (("model_m", c["m_model"]), ("measured_m", max(c["m_measured"], 0.0))):
                    row[f"adam_coord_{label}"] = (
                        None
                        if coords is None
                        else adam_coordinate_model(coords["mean"], coords["var"], int(coords["n"]), mult)
                    )
                rows.append(row)
    testbed_of = {c: CELLS[c][0] for c in cells}
    factors = {}
    for tb in ("default", "long"):
        other = {c for c in cells if testbed_of[c] != tb}
        factors[tb] = cross_factor(rows, other)  # fitted on the other testbed's cells, used on this one's
    for r in rows:
        k = factors.get(testbed_of[r["cell"]])
        r["sgd_cross_model_m"] = None if k is None else sgd_model(k * r["rho"], r["m_model"])
    for r in rows:
        y = r["measured"][0]
        for key in [k for k in r if k.endswith("_model_m") or k.endswith("_measured_m")]:
            if key.startswith("m_"):
                continue
            p = r[key]
            r[f"{key}_holds"] = None if (y is None or p is None) else abs(p / y - 1) <= TOLERANCE
    return {"rows": rows, "noise": summaries, "cross_factors": factors}


def _ci(t) -> str:
    if t is None or t[0] is None:
        return "not reached"
    return f"{t[0]:.2f}" if t[1] is None else f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]"


def _p(v, holds) -> str:
    if v is None:
        return "n/a"
    mark = "" if holds is None else (" ✓" if holds else " ✗")
    return f"{v:.2f}{mark}"


SCORED = (
    "sgd_model_m",
    "sgd_measured_m",
    "sgd_cross_model_m",
    "adam_model_m",
    "adam_measured_m",
    "adam_coord_model_m",
    "adam_coord_measured_m",
    "adam_run_model_m",
)


def markdown(table: dict, command: str) -> str:
    lines = [f"`{command}`", ""]
    lines += ["Noise at each cell's start (lr 0):", ""]
    lines += [
        "| cell | ρ (lr 0) | ρ, the run's own (GRPO, first batches) | "
        + " | ".join(f"m {c} (model / measured)" for c in NOISE_CONFIGS if c != "full")
        + " |"
    ]
    lines += ["|---|---|---|" + "---|" * (len(NOISE_CONFIGS) - 1)]
    for cell, s in table["noise"].items():
        cells = []
        for c in NOISE_CONFIGS:
            if c == "full":
                continue
            v = s["configs"].get(c)
            cells.append(
                "n/a"
                if v is None
                else f"{v['m_model']:.2f} / {v['m_measured']:.2f} [{v['m_measured_ci'][0]:.2f}, "
                f"{v['m_measured_ci'][1]:.2f}]"
            )
        rho = "∞" if math.isinf(s["rho"]) else f"{s['rho']:.2f}"
        run = s.get("rho_run")
        run = "not run" if run is None else f"{_ci(run['rho'])} ({run['seeds']} seeds)"
        lines.append(
            f"| {cell} | {rho} [{s['rho_ci'][0]:.2f}, {s['rho_ci'][1]:.2f}] | {run} | " + " | ".join(cells) + " |"
        )
    f = table["cross_factors"]
    lines += [
        "",
        f"sgd_cross: ρ × {f.get('default') or float('nan'):.2f} on the default cells (fitted on the long ones), "
        f"× {f.get('long') or float('nan'):.2f} on the long cells (fitted on the default ones).",
        "",
        "Steps to the target / GRPO's (✓: within ±15% of the measured mean):",
        "",
        "| cell | arm | target | measured (seeds reaching) | sgd, m model | sgd, m measured | sgd cross-fitted | "
        "adam, m model | adam, m measured | adam per coordinate, m model | adam per coordinate, m measured | "
        "adam, the run's own ρ, m model |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["rows"]:
        preds = " | ".join(_p(r[k], r.get(f"{k}_holds")) for k in SCORED)
        lines.append(
            f"| {r['cell']} | {r['arm']} | {r['target']:g} | {_ci(r['measured'])} ({r['reached']}) | {preds} |"
        )
    lines += ["", "Share of the predictions that hold (rows with a measured ratio):", ""]
    lines += ["| model | all | prompt fractions | kept fractions |", "|---|---|---|---|"]
    for k in SCORED:
        parts = []
        for sel in (None, "grpo_p", "cost_aware_"):
            hs = [r[f"{k}_holds"] for r in table["rows"] if r.get(f"{k}_holds") is not None]
            if sel:
                hs = [
                    r[f"{k}_holds"]
                    for r in table["rows"]
                    if r.get(f"{k}_holds") is not None and r["arm"].startswith(sel)
                ]
            parts.append(f"{sum(hs)}/{len(hs)}" if hs else "n/a")
        lines.append(f"| {k} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(DEFAULT_CELLS), help="comma-separated regime-matrix cells")
    p.add_argument("--arms", default=",".join(RESPONSE_ARMS), help="comma-separated arms for --runs")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--runs", action="store_true", help="run the cells' arms (regime_matrix's protocol)")
    p.add_argument("--noise", action="store_true", help="measure the noise terms at each cell's start (lr 0)")
    p.add_argument("--noise-steps", type=int, default=25)
    p.add_argument("--out", default=os.path.join(common.ROOT, "outputs", "bench", "response_model"))
    p.add_argument("--tag", default="response_model", help="results name: benchmarks/results/<tag>.{json,md}")
    args = p.parse_args(argv)
    cells = common.checked_names("--cells", args.cells, CELLS)
    arms = common.checked_names("--arms", args.arms, common.ARMS)
    import regime_matrix as rm

    from trl_costaware.embedded.testbed import get_testbed

    seeds = list(range(args.seeds))
    command = " ".join(["python benchmarks/response_model.py", *(argv if argv is not None else sys.argv[1:])])
    if args.runs or args.noise:
        for cell in cells:
            ctx = rm.setup_cell(cell, args.out, seeds, get_testbed(CELLS[cell][0]).steps)
            if ctx is None:
                continue
            if args.noise:
                for config in NOISE_CONFIGS:
                    m = measure_noise(ctx, config, args.out, args.noise_steps)
                    print(f"{cell} {config}: noise {m['noise']:.4g}, signal {m['signal']:.4g}", flush=True)
            if args.runs:
                for arm, seed in [("grpo", s) for s in seeds] + [(a, s) for s in seeds for a in arms if a != "grpo"]:
                    rm.run_in_cell(ctx, arm, seed)
    table = build_table(cells, args.out, args.out)
    md = markdown(table, command)
    common.write_results(args.tag, {"command": command, **table}, md)
    print(md)
    return table


if __name__ == "__main__":
    main()
