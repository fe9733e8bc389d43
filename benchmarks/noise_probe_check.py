"""The noise probe's ρ and w against the measured step ratios of the response model (issue 39 item 1).

    python benchmarks/noise_probe_check.py --runs            # GRPO with the probe, 5 cells x 3 seeds x 12 batches
    python benchmarks/noise_probe_check.py                   # the tables from what exists
    python benchmarks/noise_probe_check.py --cells default --seeds 1 --batches 2 --runs

(Run it with ``OMP_NUM_THREADS=1 WANDB_MODE=offline HF_HUB_OFFLINE=1`` on a shared CPU machine.)

**Runs.** In each cell of the regime matrix (settings below, as `regime_matrix.py` chose them; the candidate searches
are not rerun) and each seed, GRPO for `--batches` generation batches with the noise probe on every batch
(`trl_costaware/kept_count/noise_probe.py`): ``cost_aware=False``, ``cost_aware_prompt_fraction="auto"`` with
``cost_aware_max_step_ratio=1.0`` (the rule only measures, never cuts: the run is plain GRPO) and
``cost_aware_noise_probe_every=1``. Each probed batch logs the full generation batch's noise ``total`` (tr Var of the
batch-mean gradient), its ``within``-group part and the ``signal`` |𝐆|², at one point of the parameters. Runs go
under ``outputs/bench/noise_probe/<cell>/s<seed>`` and are cached (``noise_probe_run.json`` beside the metrics record
holds the settings key and is written when the run has finished).

Cells (`CELL_SETTINGS`): ``default`` and ``long``: the testbed's recipe as is; ``default_variance``: the default
testbed at 16 prompts per generation batch, lr 1e-4; ``long_variance``: the long testbed at 8 prompts, lr 3e-4
(``per_device_train_batch_size = prompts x num_generations // steps_per_generation``, as
`regime_matrix.variance_cell`); ``long_epochs``: the long testbed on a fixed pool of 128 problems
(`regime_matrix.EPOCH_CANDIDATES`).

**Analysis.** Per cell and seed: ρ_s = mean(total) / mean(signal) and w_s = mean(within) / mean(total) over the
seed's probed batches (ratios of means). Per cell: ρ and w as the ratio of the means over all seeds' batches, with a
bootstrap 95% interval resampling seeds. ρ = ∞ when the mean signal is not positive.

**Predictions** (no constant fitted), steps to a target over GRPO's under Adam, from the probe's ρ and w of the full
batch (w clamped to [0, 1] as the trainer does):

- GRPO on a fraction φ of the prompts (arms ``grpo_p*``, φ = 1 / m_model): √((1 + ρ/φ) / (1 + ρ));
- the row stage with predicted variance inflation I (arms ``cost_aware_*``, I = m_model − 1, the mean logged
  ``cost_aware/budget_inflation`` at lr 0): √((1 + ρ(1 + w I)) / (1 + ρ)): a row sample only multiplies the
  within-group part of the noise (``adam_probe``); with w = 1, rows priced as independent (``adam_probe_w1``).

Scored against every row of `benchmarks/results/response_model.json` (the measured paired ratios): a prediction holds
when |predicted / measured mean − 1| ≤ 0.15, as in `response_model.py`; that file's ``adam_model_m``,
``adam_measured_m`` and ``adam_run_model_m`` are repeated for comparison.

Results: `benchmarks/results/noise_probe_check.{json,md}`.
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
from response_model import _ci as _measured  # noqa: E402
from response_model import _p as _pred  # noqa: E402

CELLS = ("default", "default_variance", "long", "long_variance", "long_epochs")
# cell -> (testbed, (prompts per generation batch, learning rate) or None, pool or None)
CELL_SETTINGS = {
    "default": ("default", None, None),
    "default_variance": ("default", (16, 1e-4), None),
    "long": ("long", None, None),
    "long_variance": ("long", (8, 3e-4), None),
    "long_epochs": ("long", None, 128),
}
PROBE = {
    "cost_aware": False,
    "cost_aware_prompt_fraction": "auto",
    "cost_aware_max_step_ratio": 1.0,
    "cost_aware_noise_probe_every": 1,
}
TOLERANCE = 0.15
RESAMPLES = 2000
RUN_FILE = "noise_probe_run.json"
# The probe's metric names (and the names of the first commit of the probe, read as a fallback).
KEYS = {
    "total": ("cost_aware/noise_probe_total", "cost_aware/probe_total"),
    "within": ("cost_aware/noise_probe_within", "cost_aware/probe_within"),
    "signal": ("cost_aware/noise_probe_signal", "cost_aware/probe_signal"),
}
RESPONSE = os.path.join(common.RESULTS, "response_model.json")
COMPARED = ("adam_model_m", "adam_measured_m", "adam_run_model_m")
SCORED = ("adam_probe", "adam_probe_w1", *COMPARED)
LABELS = {
    "adam_probe": "adam, probe ρ and w",
    "adam_probe_w1": "adam, probe ρ, w = 1",
    "adam_model_m": "adam, lr-0 ρ, m model",
    "adam_measured_m": "adam, lr-0 ρ, m measured",
    "adam_run_model_m": "adam, the run's own ρ, m model",
}


# ==================================================================================================== the models
def adam_prompt(rho: float, phi: float) -> float:
    """√((1 + ρ/φ) / (1 + ρ)): steps of GRPO on a fraction φ of the prompts over GRPO's (√(1/φ) when ρ is ∞)."""
    if math.isinf(rho):
        return math.sqrt(1.0 / phi)
    return math.sqrt((1.0 + rho / phi) / (1.0 + rho))


def adam_kept(rho: float, w: float, inflation: float) -> float:
    """√((1 + ρ(1 + w I)) / (1 + ρ)): steps of the row stage with variance inflation I over GRPO's, the sample
    multiplying only the within-group share w of the noise (√(1 + w I) when ρ is ∞)."""
    base = 1.0 + w * inflation
    if math.isinf(rho):
        return math.sqrt(base)
    return math.sqrt((1.0 + rho * base) / (1.0 + rho))


def predict(arm: str, m_model: float, rho: float, w: float) -> float:
    """The probe model's prediction for a row of `response_model.json` (module docstring)."""
    if arm.startswith("grpo_p"):
        return adam_prompt(rho, 1.0 / m_model)
    if arm.startswith("cost_aware_"):
        return adam_kept(rho, min(max(w, 0.0), 1.0), m_model - 1.0)
    raise ValueError(f"no prediction for arm {arm!r}")


def holds(pred: float | None, measured: float | None) -> bool | None:
    if pred is None or measured is None:
        return None
    return abs(pred / measured - 1.0) <= TOLERANCE


# ==================================================================================================== the runs
def cell_settings(cell: str) -> tuple[str, dict, int | None]:
    """(testbed, settings on top of the recipe (the probe's included), pool) of a cell (module docstring)."""
    from trl_costaware.embedded.testbed import get_testbed

    testbed, variance, pool = CELL_SETTINGS[cell]
    settings = {}
    if variance is not None:
        prompts, lr = variance
        recipe = get_testbed(testbed).recipe
        per_prompt, spg = recipe["num_generations"], recipe.get("steps_per_generation", 1)
        settings = {"per_device_train_batch_size": prompts * per_prompt // spg, "learning_rate": lr}
    return testbed, {**settings, **PROBE}, pool


def check_against_regime_matrix() -> list[str]:
    """Differences between `CELL_SETTINGS` and the candidates `regime_matrix.py` tries (empty when none)."""
    import regime_matrix as rm

    issues = []
    for cell, (testbed, variance, pool) in CELL_SETTINGS.items():
        if variance is not None and variance not in rm.VARIANCE_CANDIDATES[testbed]:
            issues.append(f"{cell}: {variance} is not among regime_matrix.VARIANCE_CANDIDATES[{testbed!r}]")
        if pool is not None and pool not in [p for p, _ in rm.EPOCH_CANDIDATES[testbed]]:
            issues.append(f"{cell}: pool {pool} is not among regime_matrix.EPOCH_CANDIDATES[{testbed!r}]")
    return issues


def run_key(cell: str, seed: int, batches: int) -> dict:
    testbed, settings, pool = cell_settings(cell)
    return {"cell": cell, "testbed": testbed, "settings": settings, "pool": pool, "seed": seed, "batches": batches}


def read_probes(output_dir: str) -> dict[str, list[float]]:
    """Per probed batch: total, within and signal from the run's metrics record, and the prompt fractions the rule
    logged (1.0 on every batch when it never cut)."""
    path = os.path.join(output_dir, "cost_aware_metrics.jsonl")
    out: dict[str, list[float]] = {"total": [], "within": [], "signal": [], "prompt_fraction": []}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    for r in rows:
        values = {}
        for name, keys in KEYS.items():
            key = next((k for k in keys if isinstance(r.get(k), (int, float))), None)
            values[name] = None if key is None else float(r[key])
        if all(v is not None for v in values.values()):
            for name, v in values.items():
                out[name].append(v)
        if isinstance(r.get("cost_aware/prompt_fraction"), (int, float)):
            out["prompt_fraction"].append(float(r["cost_aware/prompt_fraction"]))
    return out


def run_probe(cell: str, seed: int, batches: int, root: str) -> dict:
    """GRPO with the probe on every batch for `batches` generation batches (cached: module docstring)."""
    out = os.path.join(root, cell, f"s{seed}")
    key = run_key(cell, seed, batches)
    path = os.path.join(out, RUN_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            cached = json.load(fh)
        if cached.get("key") == key and os.path.exists(os.path.join(out, "cost_aware_metrics.jsonl")):
            return cached
    metrics = os.path.join(out, "cost_aware_metrics.jsonl")
    for stale in (metrics, path):  # a run killed before its record, or another key: start afresh
        if os.path.exists(stale):
            os.remove(stale)
    from trl_costaware.embedded.testbed import train_run

    testbed, settings, pool = cell_settings(cell)
    result = train_run(
        seed=seed,
        output_dir=out,
        steps=batches,
        settings=settings,
        eval_every=10**6,
        eval_n=32,
        testbed=testbed,
        pool=pool,
        model_path=None,
    )
    probes = read_probes(out)
    rec = {
        "key": key,
        "probed_batches": len(probes["total"]),
        "train_wall_s": result.get("train_wall_s"),
        "eval_wall_s": result.get("eval_wall_s"),
        "phase_s": result.get("phase_s"),
    }
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(rec, fh, indent=1)
    os.replace(path + ".tmp", path)
    return rec


# ==================================================================================================== the analysis
def ratio(num: float, den: float) -> float:
    """num / den, ∞ when den is not positive."""
    return num / den if den > 0 else math.inf


def seed_stats(p: dict[str, list[float]]) -> dict:
    total, within, signal = (float(np.mean(p[k])) for k in ("total", "within", "signal"))
    return {
        "batches": len(p["total"]),
        "total": total,
        "within": within,
        "signal": signal,
        "rho": ratio(total, signal),
        "w": within / total if total > 0 else math.nan,
        "negative_signal_batches": int(sum(s <= 0 for s in p["signal"])),
        "min_prompt_fraction": min(p["prompt_fraction"]) if p.get("prompt_fraction") else None,
    }


def cell_summary(per_seed: dict[int, dict[str, list[float]]], resamples: int = RESAMPLES) -> dict | None:
    """ρ and w of a cell, pooled over its seeds' probed batches (ratios of means), with bootstrap 95% intervals
    resampling seeds (None with one seed); per seed the same (module docstring). None without probed batches."""
    per_seed = {s: p for s, p in per_seed.items() if p["total"]}
    if not per_seed:
        return None
    seeds = sorted(per_seed)
    sums = {k: np.array([np.sum(per_seed[s][k]) for s in seeds], dtype=float) for k in ("total", "within", "signal")}
    n = np.array([len(per_seed[s]["total"]) for s in seeds], dtype=float)
    total, within, signal = (float(sums[k].sum() / n.sum()) for k in ("total", "within", "signal"))
    out = {
        "seeds": seeds,
        "batches": int(n.sum()),
        "total": total,
        "within": within,
        "signal": signal,
        "rho": ratio(total, signal),
        "w": within / total if total > 0 else math.nan,
        "rho_ci": None,
        "w_ci": None,
        "per_seed": {str(s): seed_stats(per_seed[s]) for s in seeds},
    }
    if len(seeds) > 1:
        rng = np.random.default_rng(0)
        idx = rng.integers(0, len(seeds), size=(resamples, len(seeds)))
        t, wi, sg = (sums[k][idx].sum(1) for k in ("total", "within", "signal"))
        with np.errstate(divide="ignore", invalid="ignore"):
            rho_boot = np.where(sg > 0, t / sg, np.inf)
            w_boot = np.where(t > 0, wi / t, np.nan)
        out["rho_ci"] = [float(q) for q in np.quantile(rho_boot, [0.025, 0.975], method="nearest")]
        w_boot = w_boot[np.isfinite(w_boot)]
        out["w_ci"] = [float(q) for q in np.quantile(w_boot, [0.025, 0.975])] if len(w_boot) else None
    return out


def collect(cells: list[str], seeds: int, root: str) -> dict[str, dict]:
    """Per cell: the summary of its finished runs (seeds 0..seeds−1 whose record has the cell's current settings,
    whatever their batch count)."""
    out = {}
    for cell in cells:
        per_seed = {}
        for s in range(seeds):
            d = os.path.join(root, cell, f"s{s}")
            path = os.path.join(d, RUN_FILE)
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8") as fh:
                key = json.load(fh).get("key", {})
            want = run_key(cell, s, key.get("batches"))
            if key != want:
                continue
            per_seed[s] = read_probes(d)
        summary = cell_summary(per_seed)
        if summary is not None:
            out[cell] = summary
    return out


def score(response: dict, probes: dict[str, dict]) -> list[dict]:
    """Every row of `response_model.json` with the probe's predictions and the compared ones, each with its flag."""
    rows = []
    for r in response["rows"]:
        y = r["measured"][0]
        s = probes.get(r["cell"])
        row = {k: r[k] for k in ("cell", "arm", "config", "target", "m_model", "measured", "reached")}
        row["inflation"] = r["m_model"] - 1.0 if r["arm"].startswith("cost_aware_") else 0.0
        row["phi"] = 1.0 / r["m_model"] if r["arm"].startswith("grpo_p") else 1.0
        row["probe_rho"] = None if s is None else s["rho"]
        row["probe_w"] = None if s is None else s["w"]
        row["adam_probe"] = row["adam_probe_w1"] = None
        if s is not None:
            row["adam_probe_w1"] = predict(r["arm"], r["m_model"], s["rho"], 1.0)
            if not math.isnan(s["w"]) or r["arm"].startswith("grpo_p"):  # w is nan without noise (total <= 0)
                row["adam_probe"] = predict(r["arm"], r["m_model"], s["rho"], s["w"])
        for k in COMPARED:
            row[k] = r.get(k)
        for k in SCORED:
            row[f"{k}_holds"] = holds(row[k], y)
        rows.append(row)
    return rows


def shares(rows: list[dict]) -> dict[str, dict[str, list[int]]]:
    """Per model: [holding, scored] over all rows, the prompt fractions and the kept fractions."""
    out = {}
    for k in SCORED:
        out[k] = {}
        for name, prefix in (("all", ""), ("prompt fractions", "grpo_p"), ("kept fractions", "cost_aware_")):
            hs = [r[f"{k}_holds"] for r in rows if r[f"{k}_holds"] is not None and r["arm"].startswith(prefix)]
            out[k][name] = [int(sum(hs)), len(hs)]
    return out


# ==================================================================================================== the tables
def _num(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return "∞" if math.isinf(v) else f"{v:.2f}"


def _with_ci(v, ci) -> str:
    return _num(v) if not ci else f"{_num(v)} [{_num(ci[0])}, {_num(ci[1])}]"


def markdown(table: dict, command: str) -> str:
    lines = [f"`{command}`", ""]
    lines += [
        "Noise of the full generation batch from the probe (GRPO, lr > 0, one point of the parameters per batch; "
        "ratios of means over the probed batches, 95% intervals resampling seeds), against the lr-0 ρ and the run's "
        "own consecutive-steps ρ of `response_model.json`:",
        "",
        "| cell | seeds × batches | ρ probe | w = within / total | ρ per seed | w per seed | ρ lr 0 | "
        "ρ, the run's own |",
        "|---|---|---|---|---|---|---|---|",
    ]
    noise = table.get("response_noise", {})
    for cell in table["cells"]:
        s = table["probe"].get(cell)
        lr0 = noise.get(cell) or {}
        run = (lr0.get("rho_run") or {}).get("rho")
        lr0_txt = _with_ci(lr0.get("rho"), lr0.get("rho_ci")) if lr0 else "n/a"
        run_txt = "n/a" if not run else _with_ci(run[0], None if run[1] is None else run[1:])
        if s is None:
            lines.append(f"| {cell} | not run | n/a | n/a | n/a | n/a | {lr0_txt} | {run_txt} |")
            continue
        ps = s["per_seed"]
        shape = f"{len(s['seeds'])} × " + "/".join(str(v["batches"]) for v in ps.values())
        lines.append(
            f"| {cell} | {shape} | {_with_ci(s['rho'], s['rho_ci'])} | {_with_ci(s['w'], s['w_ci'])} | "
            + ", ".join(_num(v["rho"]) for v in ps.values())
            + " | "
            + ", ".join(_num(v["w"]) for v in ps.values())
            + f" | {lr0_txt} | {run_txt} |"
        )
    notes = table.get("notes") or []
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    lines += [
        "",
        "Steps to the target / GRPO's (✓: within ±15% of the measured mean). m: 1/φ for a prompt fraction, 1 + I for "
        "a row sample (I at lr 0):",
        "",
        "| cell | arm | target | measured (seeds reaching) | m model | "
        + " | ".join(LABELS[k] for k in SCORED)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(SCORED),
    ]
    for r in table["rows"]:
        preds = " | ".join(_pred(r[k], r[f"{k}_holds"]) for k in SCORED)
        lines.append(
            f"| {r['cell']} | {r['arm']} | {r['target']:g} | {_measured(r['measured'])} ({r['reached']}) | "
            f"{r['m_model']:.2f} | {preds} |"
        )
    lines += ["", "Share of the predictions that hold (rows with a measured ratio):", ""]
    lines += ["| model | all | prompt fractions | kept fractions |", "|---|---|---|---|"]
    for k, parts in table["shares"].items():
        cells = [f"{h}/{n}" if n else "n/a" for h, n in parts.values()]
        lines.append(f"| {k} ({LABELS[k]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build(cells: list[str], seeds: int, root: str, response_path: str) -> dict:
    probes = collect(cells, seeds, root)
    with open(response_path, encoding="utf-8") as fh:
        response = json.load(fh)
    notes = [f"settings: {n}" for n in check_against_regime_matrix()]
    for cell, s in probes.items():
        if math.isinf(s["rho"]):
            notes.append(f"{cell}: the mean probe signal is {s['signal']:.4g} ≤ 0: ρ = ∞")
        bad = {k: v["negative_signal_batches"] for k, v in s["per_seed"].items() if v["negative_signal_batches"]}
        if bad:
            notes.append(f"{cell}: batches with a probe signal ≤ 0, per seed: {bad}")
        cut = {k: v["min_prompt_fraction"] for k, v in s["per_seed"].items() if (v["min_prompt_fraction"] or 1) < 1}
        if cut:
            notes.append(f"{cell}: the rule cut prompts (smallest fraction per seed): {cut}")
        if not 0 <= s["w"] <= 1:
            notes.append(f"{cell}: w = {s['w']:.3f} lies outside [0, 1]; the predictions clamp it")
    rows = [r for r in score(response, probes) if r["cell"] in cells]
    return {
        "cells": cells,
        "probe": probes,
        "response_noise": {c: v for c, v in response.get("noise", {}).items() if c in cells},
        "rows": rows,
        "shares": shares(rows),
        "notes": notes,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated cells, of: {', '.join(CELLS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..S-1 (>= 1)")
    p.add_argument("--batches", type=int, default=12, help="generation batches per run, all probed (>= 1)")
    p.add_argument("--runs", action="store_true", help="run GRPO with the probe where no finished run is cached")
    p.add_argument("--out", default=os.path.join(common.ROOT, "outputs", "bench", "noise_probe"))
    p.add_argument("--response", default=RESPONSE, help="the measured step ratios (response_model.json)")
    p.add_argument("--tag", default="noise_probe_check", help="results name: benchmarks/results/<tag>.{json,md}")
    args = p.parse_args(argv)
    cells = common.checked_names("--cells", args.cells, CELL_SETTINGS)
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    if args.batches < 1:
        raise SystemExit(f"--batches must be >= 1, got {args.batches}")
    command = " ".join(["python benchmarks/noise_probe_check.py", *(argv if argv is not None else sys.argv[1:])])
    if args.runs:
        for seed in range(args.seeds):  # seed-major: a partial run holds every cell at the first seeds
            for cell in cells:
                rec = run_probe(cell, seed, args.batches, args.out)
                print(
                    f"{cell} s{seed}: {rec['probed_batches']} probed batches, train {rec['train_wall_s'] or 0:.0f}s",
                    flush=True,
                )
    table = build(cells, args.seeds, args.out, args.response)
    md = markdown(table, command)
    common.write_results(args.tag, {"command": command, **table}, md)
    print(md)
    return table


if __name__ == "__main__":
    main()
