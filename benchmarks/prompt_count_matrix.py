"""The prompt count's arms on the regime cells, and issue 39's goals (item 4).

    python benchmarks/prompt_count_matrix.py --runs        # the arms below in every cell (after response_model.py)
    python benchmarks/prompt_count_matrix.py               # the tables from what exists

Cells, seeds, protocol and run folders are `response_model.py`'s (the regime matrix's: every arm gets the same seed's
GRPO compute; the runs under `outputs/bench/response_model/`). Arms (`ARMS`):

- ``grpo``; ``cost_aware_0.5`` (today's default: the row stage, every prompt);
- ``grpo_p0.5``, ``grpo_p0.25``, ``cost_aware_0.5_p0.5``, ``cost_aware_0.5_p0.25``: fixed fractions of the prompts;
- ``cost_aware_0.5_pauto``: `cost_aware_prompt_fraction="auto"` on today's default, priced by this machine's measured
  times (`cost_aware_cost_model="time"`), the step bound at its default 1.5. Under a token price with no per-step
  term the rule's choice does not depend on the price (A = 0: J = S(φ) φ), so this arm is also the one a GPU split
  without a per-step term would run; the splits below price its tokens after the fact.
- ``cost_aware_0.5_pauto_step55``: the same rule under the token model at generation 55% with half of GRPO's
  generation cost per step that does not shrink with the batch (`cost_aware_generation_step_cost` = half of the
  generation cost of the cell's GRPO step, `cost_aware_generation_token_cost` = half the 55% price): where the rule
  should stop cutting.

Compute to each target (start + 50%, 80%, 95% of GRPO's mean gain) relative to the same seed's GRPO run, under the
CPU-like split (the cell's measured GRPO update share), generation 55% and 77% (`regime_runs.SPLITS`), and under the
per-step pricing ``step55``: a step costs 0.275 (half of generation 55%, per step) + 0.275 G_t / Ḡ + 0.45 P_t / P̄ of
GRPO's (Ḡ, P̄: the same seed's GRPO tokens per step). Goals (issue 39), each per cell, split and target:

1. on the multi-epoch cell (`long_epochs`), ``cost_aware_0.5_pauto`` ≤ 0.6× GRPO's compute at generation 55% and
   ≤ 0.7× at 77%;
2. on every cell, it is within 1.1× of the best fixed fraction in hindsight (the cheapest of the fixed-fraction arms
   with the row stage, by mean) and never dearer than today's default × 1.05 (paired ratios by seed, means);
3. it ends within 0.01 of GRPO or above at equal compute;
4. under ``step55``, ``cost_aware_0.5_pauto_step55`` is never dearer than today's default.

Results: `benchmarks/results/prompt_count_matrix.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
from prompt_analysis import FRACTIONS  # noqa: E402
from regime_analysis import _end, _end_within, _reach  # noqa: E402
from regime_runs import CELLS, grpo_split_weights, load_cell_runs  # noqa: E402
from token_efficiency import bootstrap_ci  # noqa: E402

ARMS = (
    "grpo",
    "cost_aware_0.5",
    "grpo_p0.5",
    "grpo_p0.25",
    "cost_aware_0.5_p0.5",
    "cost_aware_0.5_p0.25",
    "cost_aware_0.5_pauto",
    "cost_aware_0.5_pauto_step55",
    "cost_aware_compute_pauto",
)
AUTO, STEP_AUTO, DEFAULT = "cost_aware_0.5_pauto", "cost_aware_0.5_pauto_step55", "cost_aware_0.5"
COMPUTE_AUTO = "cost_aware_compute_pauto"  # both counts from one cost model (the goals are scored for it too)
FIXED = ("cost_aware_0.5", "cost_aware_0.5_p0.5", "cost_aware_0.5_p0.25")  # the row stage at fixed prompt fractions
SPLITS = ("cpu", "gpu", "gpu_gen77", "step55")
EPOCHS_GOAL = {"gpu": 0.6, "gpu_gen77": 0.7}
TOLERANCE = 0.01
# The "auto" rule's start-up: the generation batches before its first decision. With the noise probe (the default
# since issue 39's second session) MIN_PROBES + 1 = 3; it was MIN_NOISE_PAIRS + 1 = 5 with the consecutive steps'
# estimator, the rule that `prompt_count_matrix.{json,md}` ran.
WARMUP_BATCHES = 3
STEP_SHARE = 0.5  # the share of GRPO's generation cost that is per step under the step55 pricing
GEN_SHARE = 0.55


def step_priced_settings(testbed: str, grpo_generated_per_step: float) -> dict:
    """The token model's prices for ``cost_aware_0.5_pauto_step55`` on a cell (module docstring), in policy tokens:
    the 55% price of a generated token split into a per-step part (half of GRPO's generation cost per step) and a
    per-token part (half the price)."""
    price = common.generation_token_cost(testbed, GEN_SHARE)
    return {
        "cost_aware_cost_model": "tokens",
        "cost_aware_generation_token_cost": round(price * (1 - STEP_SHARE), 6),
        "cost_aware_generation_step_cost": round(price * STEP_SHARE * grpo_generated_per_step, 3),
    }


def _with_splits(run: dict, weights: dict, grpo: dict) -> list[dict]:
    """The run's curve with its compute under each split (baseline-step units of the same seed's GRPO run)."""
    steps = grpo["curve"][-1]["step"]
    gbar, pbar = grpo["totals"]["generated_tokens"] / steps, grpo["totals"]["policy_tokens"] / steps
    s_gen = GEN_SHARE * STEP_SHARE
    out = []
    for p in run["curve"]:
        q = {**p, **{f"compute_{k}": w.compute(p["generated_tokens"], p["policy_tokens"]) for k, w in weights.items()}}
        q["compute_step55"] = (
            s_gen * p["step"] + s_gen * p["generated_tokens"] / gbar + (1 - GEN_SHARE) * p["policy_tokens"] / pbar
        )
        out.append(q)
    return out


def analyse_cell(cell_root: str) -> dict:
    runs = load_cell_runs(cell_root)
    grpo = runs.get("grpo", {})
    if not grpo:
        return {"status": "no GRPO run"}
    steps = next(iter(grpo.values()))["steps"]
    start = float(np.mean([r["heldout_acc_start"] for r in grpo.values()]))
    gain = bootstrap_ci([_end(r) - r["heldout_acc_start"] for r in grpo.values()])
    targets = {f: start + f * gain[0] for f in FRACTIONS}
    keys = ("step", *(f"compute_{k}" for k in SPLITS))
    out = {"status": "run", "start": start, "grpo_gain": gain, "targets": targets, "arms": {}}
    for arm in [a for a in ARMS if a in runs]:
        rows = []
        for s, run in sorted(runs[arm].items()):
            if s not in grpo:
                continue
            w = grpo_split_weights(grpo, s, steps)
            c, g = _with_splits(run, w, grpo[s]), _with_splits(grpo[s], w, grpo[s])
            row = {"seed": s, "steps_run": c[-1]["step"], "grpo_end": _end(grpo[s])}
            logged = [r for r in _metrics(cell_root, arm, s) if r.get("cost_aware/prompt_fraction") is not None]
            fr = [r["cost_aware/prompt_fraction"] for r in logged]
            row["prompt_fraction"] = float(np.mean(fr)) if fr else 1.0
            if "auto" in arm and len(logged) > WARMUP_BATCHES:
                # what the rule's start-up costs: the compute of its first batches (every prompt until the noise
                # scale has its pairs), at generation 55%, against GRPO's compute to the 80% target
                first = logged[WARMUP_BATCHES - 1]
                start = w["gpu"].compute(first["cost_aware/generated_tokens"], first["cost_aware/policy_tokens"])
                g_hit = _reach(g, targets[0.8], keys)
                row["warmup_share_of_grpo_to_0.8"] = start / g_hit["compute_gpu"] if g_hit else None
            for k in SPLITS:
                row[f"end_{k}"] = _end_within(c, f"compute_{k}", g[-1][f"compute_{k}"])
            for f, t in targets.items():
                hit, g_hit = _reach(c, t, keys), _reach(g, t, keys)
                row[f"reached_{f}"] = hit is not None
                if hit and g_hit:
                    for k in keys:
                        row[f"ratio_{k}_{f}"] = hit[k] / g_hit[k]
            rows.append(row)
        a = {"n": len(rows), "per_seed": rows, "prompt_fraction": bootstrap_ci([r["prompt_fraction"] for r in rows])}
        a["warmup_share_of_grpo_to_0.8"] = bootstrap_ci([r.get("warmup_share_of_grpo_to_0.8") for r in rows])
        for f in FRACTIONS:
            a[f"reached_{f}"] = sum(r[f"reached_{f}"] for r in rows)
            for k in keys:
                a[f"ratio_{k}_{f}"] = bootstrap_ci([r.get(f"ratio_{k}_{f}") for r in rows])
        for k in SPLITS:
            a[f"end_{k}_minus_grpo"] = bootstrap_ci(
                [r[f"end_{k}"] - r["grpo_end"] for r in rows if r[f"end_{k}"] is not None]
            )
        out["arms"][arm] = a
    return out


def _metrics(cell_root, arm, seed):
    from regime_runs import read_metrics

    return read_metrics(os.path.join(cell_root, f"{arm}__s{seed}"))


def _paired(cell: dict, arm: str, other: str, key: str) -> tuple:
    mine = {r["seed"]: r for r in cell["arms"].get(arm, {}).get("per_seed", [])}
    theirs = {r["seed"]: r for r in cell["arms"].get(other, {}).get("per_seed", [])}
    vals = [mine[s][key] / theirs[s][key] for s in mine if s in theirs and key in mine[s] and key in theirs[s]]
    return bootstrap_ci(vals)


def goals(cell_name: str, cell: dict, arm: str = AUTO) -> dict:
    """Issue 39's goals for `arm` (module docstring; `AUTO` or `COMPUTE_AUTO`)."""
    arms = cell["arms"]
    out = {}
    auto = arms.get(arm)
    if auto is None or auto["n"] < 3:
        return {"status": "no claim (fewer than 3 seeds of the auto arm)"}
    for f in FRACTIONS:
        reached = auto[f"reached_{f}"] == auto["n"]
        if CELLS[cell_name][1] == "epochs":
            for k, limit in EPOCHS_GOAL.items():
                r = auto[f"ratio_compute_{k}_{f}"]
                out[f"epochs_{k}_{f}"] = {"ratio": r, "limit": limit, "met": bool(reached and r[0] and r[0] <= limit)}
        for k in ("cpu", "gpu", "gpu_gen77"):
            key = f"ratio_compute_{k}_{f}"
            fixed = {a: arms[a][key][0] for a in FIXED if a in arms and arms[a][key][0] is not None}
            if fixed:
                best = min(fixed, key=fixed.get)
                r = _paired(cell, arm, best, key)
                out[f"vs_best_{k}_{f}"] = {"best": best, "ratio": r, "met": bool(reached and r[0] and r[0] <= 1.1)}
            r = _paired(cell, arm, DEFAULT, key)
            out[f"vs_default_{k}_{f}"] = {"ratio": r, "met": bool(reached and r[0] and r[0] <= 1.05)}
        step = arms.get(STEP_AUTO)
        if step is not None:
            r = _paired(cell, STEP_AUTO, DEFAULT, f"ratio_compute_step55_{f}")
            out[f"step55_vs_default_{f}"] = {"ratio": r, "met": bool(r[0] and r[0] <= 1.0)}
    for k in ("cpu", "gpu", "gpu_gen77"):
        d = auto[f"end_{k}_minus_grpo"]
        out[f"end_{k}"] = {"delta": d, "met": d[0] is not None and d[0] >= -TOLERANCE}
    return out


def _ci(t, digits=2, signed=False) -> str:
    if t is None or t[0] is None:
        return "not reached"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f.format(t[0]) if t[1] is None else f"{f.format(t[0])} [{f.format(t[1])}, {f.format(t[2])}]"


def markdown(cells: dict, command: str) -> str:
    lines = [f"`{command}`", ""]
    for name, cell in cells.items():
        if cell.get("status") != "run":
            lines += [f"### {name}: {cell.get('status')}", ""]
            continue
        lines += [f"### {name} (GRPO gain {_ci(cell['grpo_gain'], 3, True)}; targets 50/80/95% of it)", ""]
        head = "| arm | seeds | prompt fraction | " + " | ".join(
            f"{k} @{f:g}" for k in ("steps", *SPLITS) for f in FRACTIONS
        )
        lines += [head + " | end − GRPO at equal compute (gen 55%) |", "|---" * (4 + 5 * len(FRACTIONS)) + "|"]
        for arm, a in cell["arms"].items():
            vals = [
                _ci(a[f"ratio_{k}_{f}"]) + ("" if a[f"reached_{f}"] == a["n"] else f" ({a[f'reached_{f}']}/{a['n']})")
                for k in ("step", *(f"compute_{s}" for s in SPLITS))
                for f in FRACTIONS
            ]
            lines.append(
                f"| {arm} | {a['n']} | {_ci(a['prompt_fraction'])} | "
                + " | ".join(vals)
                + f" | {_ci(a['end_gpu_minus_grpo'], 3, True)} |"
            )
        for arm, a in cell["arms"].items():
            share = a.get("warmup_share_of_grpo_to_0.8")
            if share and share[0] is not None:
                lines.append(
                    f"\n{arm}: its first {WARMUP_BATCHES} generation batches (before the noise is measured) cost "
                    f"{_ci(share)} of GRPO's compute to the 80% target (generation 55%)."
                )
        for label, field in ((AUTO, "goals"), (COMPUTE_AUTO, "goals_compute")):
            g = cell.get(field)
            if g is None:
                continue
            if "status" in g:
                lines += ["", f"Goals ({label}): {g['status']}", ""]
                continue
            met = sum(v["met"] for v in g.values())
            lines += ["", f"Goals ({label}) met: {met} of {len(g)}. Not met:", ""]
            for key, v in g.items():
                if not v["met"]:
                    detail = _ci(v.get("ratio") or v.get("delta"), 3)
                    lines.append(f"- {key}: {detail}" + (f" (best fixed: {v['best']})" if "best" in v else ""))
            lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="default,default_variance,long,long_variance,long_epochs")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms for --runs")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--runs", action="store_true")
    p.add_argument("--out", default=os.path.join(common.ROOT, "outputs", "bench", "response_model"))
    p.add_argument("--tag", default="prompt_count_matrix")
    args = p.parse_args(argv)
    cells = common.checked_names("--cells", args.cells, CELLS)
    arms = common.checked_names("--arms", args.arms, ARMS)
    command = " ".join(["python benchmarks/prompt_count_matrix.py", *(argv if argv is not None else sys.argv[1:])])
    if args.runs:
        import regime_matrix as rm

        from trl_costaware.embedded.testbed import get_testbed

        seeds = list(range(args.seeds))
        for cell in cells:
            ctx = rm.setup_cell(cell, args.out, seeds, get_testbed(CELLS[cell][0]).steps)
            if ctx is None:
                continue
            for s in seeds:
                rm.run_in_cell(ctx, "grpo", s)
            grpo = load_cell_runs(ctx["root"])["grpo"]
            gen = float(np.mean([r["totals"]["generated_tokens"] / r["steps"] for r in grpo.values()]))
            for s in seeds:
                for arm in [a for a in arms if a != "grpo"]:
                    if arm == STEP_AUTO:  # the cell's own per-step price on top of the arm's settings
                        extra = {**ctx["extra"], **step_priced_settings(ctx["testbed"], gen)}
                        rm.run_in_cell({**ctx, "extra": extra}, STEP_AUTO, s)
                    else:
                        rm.run_in_cell(ctx, arm, s)
    results = {}
    for cell in cells:
        rec_path = os.path.join(args.out, "cells", f"{cell}.json")
        if not os.path.exists(rec_path):
            results[cell] = {"status": "not run"}
            continue
        with open(rec_path, encoding="utf-8") as fh:
            rec = json.load(fh)
        res = analyse_cell(rec["runs"]) if rec.get("runs") else {"status": "no candidate has the property"}
        if res.get("status") == "run":
            res["goals"] = goals(cell, res)
            if COMPUTE_AUTO in res["arms"]:
                res["goals_compute"] = goals(cell, res, COMPUTE_AUTO)
        results[cell] = res
    md = markdown(results, command)
    common.write_results(args.tag, {"command": command, "cells": results}, md)
    print(md)
    return results


if __name__ == "__main__":
    main()
