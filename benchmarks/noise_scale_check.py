"""How well the gradient noise scale predicts what the update's noise costs in steps (issue 25; BENCHMARKS.md §8).

    python benchmarks/noise_scale_check.py                 # every regime-matrix cell (its runs must exist)
    python benchmarks/noise_scale_check.py --cells default,long --steps 25

For each cell, the noise scale ρ = B_noise / N at the cell's start, measured as the "compute" rule measures it
(`trl_costaware/kept_count/step_signals.py`) but with the learning rate at 0, so that the parameters do not move and
consecutive steps' gradients are independent draws at one point (no drift between them): ρ = (mean |G_t|² − mean
G_t·G_{t−1}) / mean G_t·G_{t−1} over `--steps` generation batches of the cell's recipe, every informative row kept (I =
0), with a bootstrap interval over steps. The model the rule uses predicts that halving the batch multiplies the steps
to a target by (1 + 2ρ) / (1 + ρ). The cell's measured response is GRPO on half the prompts against GRPO (steps to the
target, paired seeds): from the regime matrix's runs for the variance-limited cells, from the committed
token-efficiency runs (`compute_to_target.json`) for the testbeds as they are. The ρ that would explain it is
ρ_eff = (r − 1) / (2 − r), and ρ_eff / ρ is the factor by which the model over- (< 1) or under-predicts.

`--inflation TESTBEDS` measures, also at lr 0 and from the same seed's batches, how much gradient noise a sample of
the rows really adds, against what the rule's inflation I(m) predicts (`budget.variance_inflation`, which takes the
rows as independent): the noise E|G_t|² − E[G_t·G_{t−1}] of the full batch, of a uniform half of its informative rows
(I = 1 where every row is informative), of the method's half (|A|/√c, its own I), and of GRPO on half the prompts. The
model says noise(sample) / noise(full) = 1 + I; the measured c = (ratio − 1) / I is the share of the predicted
inflation that is real.

Results: `benchmarks/results/noise_scale_check.{json,md}` (and `noise_inflation_check.{json,md}`); runs under
`outputs/bench/noise_scale_check/`.
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
from regime_runs import CELLS, load_cell_runs  # noqa: E402

# GRPO-half's steps to the target over GRPO's on the testbeds as they are (compute_to_target.json, §7).
AS_IS_RESPONSE_FILE = "compute_to_target.json"


def _rho(sq: np.ndarray, dot: np.ndarray) -> float:
    """(mean |G|² − mean G·G') / mean G·G', ∞ when the mean dot product is not positive (noise dominates)."""
    signal = dot.mean()
    return float((sq.mean() - signal) / signal) if signal > 0 else math.inf


def measure_rho(cell: str, matrix_root: str, out_root: str, steps: int, seed: int = 0, reuse: bool = False) -> dict:
    """ρ at the cell's start with the learning rate at 0 (module docstring); `reuse`: read a finished run's metrics
    instead of training again."""
    from trl_costaware.embedded.testbed import train_run

    with open(os.path.join(matrix_root, "cells", f"{cell}.json"), encoding="utf-8") as fh:
        record = json.load(fh)
    testbed = CELLS[cell][0]
    settings = {
        "cost_aware": True,
        "cost_aware_kept_fraction": "compute",
        "cost_aware_cost_model": "tokens",
        "cost_aware_generation_token_cost": 1e6,  # generation dominant: every informative row is kept
        "cost_aware_weight_normalization": "none",
        **record.get("extra", {}),
        "learning_rate": 0.0,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
    }
    out = os.path.join(out_root, cell)
    metrics = os.path.join(out, "cost_aware_metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    train_run(
        seed=seed, output_dir=out, steps=steps, settings=settings, testbed=testbed, model_path=record.get("model_path")
    )
    with open(metrics, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    sq = np.array([r["cost_aware/noise_grad_sq"] for r in rows if "cost_aware/noise_grad_dot" in r])
    dot = np.array([r["cost_aware/noise_grad_dot"] for r in rows if "cost_aware/noise_grad_dot" in r])
    kept = [r["cost_aware/kept_row_fraction"] for r in rows if "cost_aware/kept_row_fraction" in r]
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(sq), size=(10_000, len(sq)))
    boot = [_rho(sq[i], dot[i]) for i in idx]
    rho = _rho(sq, dot)
    lo, hi = (float(q) for q in np.quantile(boot, [0.025, 0.975], method="nearest"))  # ∞ among them
    return {"rho": rho, "rho_ci": (lo, hi), "pairs": int(len(sq)), "kept_row_fraction": float(np.mean(kept))}


def measured_response(cell: str, matrix_root: str) -> dict | None:
    """GRPO-half's steps to the target over GRPO's (mean, bootstrap interval, seeds, source), or None: from the
    cell's own runs in the regime matrix (the variance-limited cells' search, or a `grpo_half` arm run in the cell),
    else, for a testbed as it is, from the committed token-efficiency runs."""
    from regime_analysis import analyse_cell

    testbed, kind = CELLS[cell]
    with open(os.path.join(matrix_root, "cells", f"{cell}.json"), encoding="utf-8") as fh:
        record = json.load(fh)
    if load_cell_runs(record["runs"]).get("grpo_half"):
        arm = analyse_cell(cell, matrix_root)["arms"]["grpo_half"]
        if arm["ratio_step"][0] is not None:
            return {"ratio": arm["ratio_step"], "seeds": arm["n"], "source": "regime matrix"}
    if kind == "as_is":
        with open(os.path.join(common.RESULTS, AS_IS_RESPONSE_FILE), encoding="utf-8") as fh:
            arm = json.load(fh)["testbeds"].get(testbed, {}).get("arms", {}).get("grpo_half")
        if arm is not None:
            return {"ratio": arm["ratio_step"], "seeds": arm["n"], "source": AS_IS_RESPONSE_FILE}
    return None


INFLATION_ARMS = {
    "full": {"cost_aware": False},
    "half_rows_uniform": {"cost_aware_kept_fraction": 0.5, "cost_aware_proxy": "uniform"},
    "half_rows_method": {"cost_aware_kept_fraction": 0.5},
    "half_prompts": {"cost_aware": False, "half_prompts": True},
}


def measure_noise(testbed: str, arm: str, out_root: str, steps: int, seed: int = 0) -> dict:
    """Mean noise term |G_t|² − G_t·G_{t−1} at lr 0 (bootstrap interval over steps) for one arm of
    `INFLATION_ARMS`, with the step gradients read before clipping, and the arm's mean predicted inflation."""
    import torch

    from trl_costaware import CostAwareGRPOTrainer
    from trl_costaware.embedded.testbed import get_testbed, train_run

    grads = []

    class Reading(CostAwareGRPOTrainer):
        def _clip_grad_norm(self, model):
            grads.append(
                torch.cat([p.grad.detach().flatten().double() for p in model.parameters() if p.grad is not None])
            )
            return super()._clip_grad_norm(model)

    settings = {
        "cost_aware": True,
        "cost_aware_weight_normalization": "none",
        "learning_rate": 0.0,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
        **INFLATION_ARMS[arm],
    }
    if settings.pop("half_prompts", False):
        settings["per_device_train_batch_size"] = get_testbed(testbed).recipe["per_device_train_batch_size"] // 2
    out = os.path.join(out_root, f"inflation_{testbed}_{arm}")
    metrics = os.path.join(out, "cost_aware_metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    train_run(seed=seed, output_dir=out, steps=steps, settings=settings, trainer_cls=Reading, testbed=testbed)
    with open(metrics, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    inflation = [r["cost_aware/budget_inflation"] for r in rows if "cost_aware/budget_inflation" in r]
    g = torch.stack(grads)
    noise = np.array([float(g[i] @ g[i] - g[i] @ g[i - 1]) for i in range(1, len(g))])
    idx = np.random.default_rng(0).integers(0, len(noise), size=(10_000, len(noise)))
    lo, hi = (float(q) for q in np.quantile(noise[idx].mean(1), [0.025, 0.975]))
    return {"noise": float(noise.mean()), "noise_ci": (lo, hi), "inflation": float(np.mean(inflation or [0.0]))}


def inflation_check(testbeds: list[str], out_root: str, steps: int) -> str:
    rows = []
    for tb in testbeds:
        full = None
        for arm in INFLATION_ARMS:
            m = measure_noise(tb, arm, out_root, steps)
            full = full or m
            ratio = m["noise"] / full["noise"]
            predicted = 2.0 if arm == "half_prompts" else 1 + m["inflation"]
            real = (ratio - 1) / (predicted - 1) if predicted > 1 else None
            rows.append({"testbed": tb, "arm": arm, **m, "ratio": ratio, "predicted": predicted, "real_share": real})
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        "| testbed | batch | noise at lr 0 | predicted I (mean) | noise / full batch's: predicted | measured"
        " | real share c |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = "n/a" if r["real_share"] is None else f"{r['real_share']:.2f}"
        lines.append(
            f"| {r['testbed']} | {r['arm']} | {r['noise']:.4g} [{r['noise_ci'][0]:.4g}, {r['noise_ci'][1]:.4g}] | "
            f"{r['inflation']:.2f} | {r['predicted']:.2f} | {r['ratio']:.2f} | {c} |"
        )
    with open(os.path.join(common.RESULTS, "noise_inflation_check.json"), "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
    md = "\n".join(lines)
    with open(os.path.join(common.RESULTS, "noise_inflation_check.md"), "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    return md


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--matrix", default=os.path.join(common.ROOT, "outputs", "bench", "regime_matrix"))
    p.add_argument("--out", default=os.path.join(common.ROOT, "outputs", "bench", "noise_scale_check"))
    p.add_argument("--reuse", action="store_true", help="read finished runs' metrics instead of training again")
    p.add_argument("--inflation", default=None, help="comma-separated testbeds: the inflation check only")
    args = p.parse_args(argv)
    if args.inflation:
        print(inflation_check(args.inflation.split(","), args.out, args.steps))
        return
    rows = []
    for cell in args.cells.split(","):
        m = measure_rho(cell, args.matrix, args.out, args.steps, reuse=args.reuse)
        r = measured_response(cell, args.matrix)
        predicted = 2.0 if math.isinf(m["rho"]) else (1 + 2 * m["rho"]) / (1 + m["rho"])
        row = {"cell": cell, **m, "predicted_half_ratio": predicted, "response": r}
        if r is not None:
            ratio = r["ratio"][0]
            row["rho_eff"] = (ratio - 1) / (2 - ratio) if ratio < 2 else float("inf")
            row["factor"] = row["rho_eff"] / m["rho"] if 0 < m["rho"] < math.inf else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    lines = [
        "`python benchmarks/noise_scale_check.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
        "",
        "| cell | ρ at the start (lr 0) | pairs | kept rows | predicted steps, half batch | measured steps, GRPO-half"
        " (seeds) | ρ_eff | ρ_eff / ρ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        resp = r["response"]
        measured = "n/a" if resp is None else f"{_ci(resp['ratio'])} ({resp['seeds']}, {resp['source']})"
        eff = "n/a" if "rho_eff" not in r else f"{r['rho_eff']:.2f}"
        fac = "n/a" if r.get("factor") is None else f"{r['factor']:.2f}"
        lines.append(
            f"| {r['cell']} | {_f(r['rho'])} [{_f(r['rho_ci'][0])}, {_f(r['rho_ci'][1])}] | {r['pairs']} | "
            f"{r['kept_row_fraction']:.2f} | {r['predicted_half_ratio']:.2f} | {measured} | {eff} | {fac} |"
        )
    md = "\n".join(lines)
    os.makedirs(common.RESULTS, exist_ok=True)
    with open(os.path.join(common.RESULTS, "noise_scale_check.json"), "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
    with open(os.path.join(common.RESULTS, "noise_scale_check.md"), "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    print(md)


def _f(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.2f}"


def _ci(t) -> str:
    return f"{t[0]:.2f}" if t[1] is None else f"{t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]"


if __name__ == "__main__":
    main()
