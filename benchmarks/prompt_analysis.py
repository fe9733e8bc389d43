"""Issue 34's analysis of the regime matrix's multi-epoch cells: the prompt stage against GRPO, the row sampler
alone (today's default) and a GRESO-style biased skip.

    python benchmarks/prompt_analysis.py [--root outputs/bench/prompt_matrix] [--cells long_epochs,default_epochs]

Per cell: targets along GRPO's whole run, start + f × GRPO's mean gain for f in `FRACTIONS`. Per arm and seed, paired
with the same seed's GRPO run (the same prompts: the pool is fixed, `POOL_SEED`): compute to each target under each
split (tokens weighted as `regime_matrix.grpo_split_weights`: the cell's measured CPU-like split, generation 55% and
77%), generated tokens to each target, end accuracy at equal compute (last evaluations within GRPO's compute) minus
GRPO's; means over seeds with bootstrap 95% intervals. Then issue 34's goals, each met or not:

1. both stages reach each target with <= 0.6x GRPO's compute at generation 55% and <= 0.7x at 77%, and end within
   0.01 of GRPO or above at equal compute;
2. both stages are not dearer than the GRESO-style skip (paired compute ratio both / greso <= 1, per target, split);
3. (the existing cells) not measured here.

Results: benchmarks/results/prompt_matrix.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
from regime_analysis import SPLIT_NAMES, _end, _end_within, _reach, _with_compute  # noqa: E402
from regime_runs import grpo_split_weights, load_cell_runs, read_metrics  # noqa: E402
from token_efficiency import bootstrap_ci  # noqa: E402

FRACTIONS = (0.5, 0.8, 0.95)
ARM_ORDER = ("cost_aware_0.5", "greso", "prompt", "both", "grpo_half", "cost_aware_0.5_half", "both_half")
SPLIT_LABELS = {"cpu": "CPU-like", "gpu": "gen 55%", "gpu_gen77": "gen 77%"}
GOAL_RATIO = {"gpu": 0.6, "gpu_gen77": 0.7}
TOLERANCE = 0.01


def _fmt(ci, digits=2, signed=False):
    mean, lo, hi = ci
    if mean is None:
        return "n/a"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    if lo is None:
        return f.format(mean)
    return f"{f.format(mean)} [{f.format(lo)}, {f.format(hi)}]"


def analyse(cell_root: str, kind: str = "epochs") -> dict:
    runs = load_cell_runs(cell_root)
    grpo = runs.get("grpo", {})
    if not grpo:
        return {"status": "no GRPO run"}
    steps = next(iter(grpo.values()))["steps"]
    start = float(np.mean([r["heldout_acc_start"] for r in grpo.values()]))
    gain = bootstrap_ci([_end(r) - r["heldout_acc_start"] for r in grpo.values()])
    targets = {f: start + f * gain[0] for f in FRACTIONS}
    keys = ("step", "generated_tokens", "policy_tokens", *(f"compute_{k}" for k in SPLIT_NAMES))
    shares = [
        np.mean(r["zero_variance_shares"][-max(1, len(r["zero_variance_shares"]) // 4) :]) for r in grpo.values()
    ]
    out = {
        "status": "run",
        "steps": steps,
        "seeds": sorted(grpo),
        "start": start,
        "grpo_gain": gain,
        "targets": targets,
        "grpo_zero_variance_share_last_quarter": bootstrap_ci(shares),
        "arms": {},
    }
    curves = {}  # (arm, seed) -> curve with compute
    for arm, by_seed in runs.items():
        rows = []
        for s in sorted(by_seed):
            if s not in grpo:
                continue
            w = grpo_split_weights(grpo, s, steps)
            c, g = _with_compute(by_seed[s], w), _with_compute(grpo[s], w)
            curves[(arm, s)] = c
            row = {"seed": s, "steps_run": c[-1]["step"], "grpo_end": _end(grpo[s])}
            for k in SPLIT_NAMES:
                limit = w[k].compute(g[-1]["generated_tokens"], g[-1]["policy_tokens"])
                row[f"end_equal_compute_{k}"] = _end_within(c, f"compute_{k}", limit)
            zs = by_seed[s].get("zero_variance_shares") or []
            row["zero_variance_share"] = float(np.mean(zs)) if zs else None
            row.update(prediction_quality(os.path.join(cell_root, f"{arm}__s{s}")))
            for f, t in targets.items():
                hit, g_hit = _reach(c, t, keys), _reach(g, t, keys)
                row[f"reached_{f}"] = hit is not None
                if hit and g_hit:
                    for k in keys:
                        if g_hit[k] > 0:
                            row[f"ratio_{k}_{f}"] = hit[k] / g_hit[k]
            rows.append(row)
        a = {"n": len(rows), "per_seed": rows}
        for k in ("zero_variance_share", *PREDICTION_KEYS):
            a[k] = bootstrap_ci([r.get(k) for r in rows])
        for f in FRACTIONS:
            a[f"reached_{f}"] = sum(r[f"reached_{f}"] for r in rows)
            for k in keys:
                a[f"ratio_{k}_{f}"] = bootstrap_ci([r.get(f"ratio_{k}_{f}") for r in rows])
        for k in SPLIT_NAMES:
            a[f"end_equal_compute_{k}_minus_grpo"] = bootstrap_ci(
                [r[f"end_equal_compute_{k}"] - r["grpo_end"] for r in rows if r[f"end_equal_compute_{k}"] is not None]
            )
        out["arms"][arm] = a
    out["kind"] = kind
    out["both_vs_greso"] = _paired(runs, "both", "greso", targets, out["arms"])
    out["both_vs_default"] = _paired(runs, "both", "cost_aware_0.5", targets, out["arms"])
    # the saving taken as cheaper steps: is it the prompt stage's, or the halved prompt count's?
    out["both_half_vs_default_half"] = _paired(runs, "both_half", "cost_aware_0.5_half", targets, out["arms"])
    out["goals"] = _goals(out)
    return out


PREDICTION_KEYS = ("predicted_zero_variance", "observed_zero_variance", "brier", "brier_base_rate")


def prediction_quality(run_dir: str) -> dict:
    """Over the last quarter of a prompt-stage run's steps: the mean predicted P(zero variance) of the drawn prompts,
    the observed share of zero-variance groups, the history's Brier score, and the Brier score of the constant
    predictor at the observed share (a history that predicts no better than the base rate gives the prompt stage
    nothing to choose by). Empty for runs without the prompt stage."""
    rows = [r for r in read_metrics(run_dir) if "cost_aware/prompt_zero_variance_brier" in r]
    rows = rows[-max(1, len(rows) // 4) :]
    if not rows:
        return {}
    observed = np.array([r["cost_aware/prompt_zero_variance_groups"] for r in rows])
    base = float(observed.mean())
    return {
        "predicted_zero_variance": float(np.mean([r["cost_aware/prompt_predicted_zero_variance"] for r in rows])),
        "observed_zero_variance": base,
        "brier": float(np.mean([r["cost_aware/prompt_zero_variance_brier"] for r in rows])),
        # per batch: E[(c − z)²] over its groups = f(1 − f) + (f − c)², f the batch's observed share, c = base
        "brier_base_rate": float(np.mean(observed * (1 - observed) + (observed - base) ** 2)),
    }


def _paired(runs, arm, other, targets, arms) -> dict:
    """Per target and split: the per-seed ratio of the two arms' compute-to-target ratios (both against GRPO)."""
    res = {}
    if arm not in arms or other not in arms:
        return res
    mine = {r["seed"]: r for r in arms[arm]["per_seed"]}
    theirs = {r["seed"]: r for r in arms[other]["per_seed"]}
    for f in targets:
        for k in SPLIT_NAMES:
            key = f"ratio_compute_{k}_{f}"
            vals = [mine[s][key] / theirs[s][key] for s in mine if s in theirs and key in mine[s] and key in theirs[s]]
            res[f"{k}_{f}"] = bootstrap_ci(vals)
    return res


def _goals(cell: dict) -> dict:
    both = cell["arms"].get("both")
    if both is None or both["n"] < 3:
        return {"status": "no claim (fewer than 3 seeds of both stages)"}
    goals = {}
    for f in FRACTIONS if cell.get("kind") == "epochs" else ():  # goal 1 is the multi-epoch cells'
        for k, limit in GOAL_RATIO.items():
            r = both[f"ratio_compute_{k}_{f}"]
            reached = both[f"reached_{f}"] == both["n"]
            goals[f"compute_{k}_{f}"] = {
                "ratio": r,
                "limit": limit,
                "met": bool(reached and r[0] is not None and r[0] <= limit),
                "reached": f"{both[f'reached_{f}']}/{both['n']}",
            }
    for k in SPLIT_NAMES:
        end = both[f"end_equal_compute_{k}_minus_grpo"]
        goals[f"end_{k}"] = {"delta": end, "met": end[0] is not None and end[0] >= -TOLERANCE}
    for key, r in cell["both_vs_greso"].items():
        goals[f"vs_greso_{key}"] = {"ratio": r, "met": r[0] is not None and r[0] <= 1.0}
    # goal 3 (every cell): not worse than today's default (rows only) — worse = a paired ratio whose interval is
    # above 1, or an end accuracy at equal compute below the default's by more than the tolerance
    default = cell["arms"].get("cost_aware_0.5")
    for key, r in cell["both_vs_default"].items():
        goals[f"vs_default_{key}"] = {"ratio": r, "met": r[0] is not None and not (r[1] is not None and r[1] > 1.0)}
    if default is not None:
        for k in SPLIT_NAMES:
            mine, theirs = (
                both[f"end_equal_compute_{k}_minus_grpo"][0],
                default[f"end_equal_compute_{k}_minus_grpo"][0],
            )
            if mine is not None and theirs is not None:
                goals[f"end_vs_default_{k}"] = {
                    "delta": (mine - theirs, None, None),
                    "met": mine - theirs >= -TOLERANCE,
                }
    return goals


def markdown(cells: dict, command: str) -> str:
    lines = [f"Command: `{command}`", ""]
    for cell, res in cells.items():
        if res.get("status") != "run":
            lines += [f"**{cell}**: {res.get('status')}", ""]
            continue
        lines += [
            f"**{cell}** ({len(res['seeds'])} seeds, GRPO {res['steps']} steps): start {res['start']:.3f}, GRPO gain "
            f"{_fmt(res['grpo_gain'], 3)}, GRPO's zero-variance token share in its last quarter "
            f"{_fmt(res['grpo_zero_variance_share_last_quarter'])}; targets "
            + ", ".join(f"{int(f * 100)}%: {t:.3f}" for f, t in res["targets"].items()),
            "",
            "Ratios to GRPO (same seed, same prompts), mean [bootstrap 95% CI over seeds]:",
            "",
            "| arm | target | reached | compute CPU-like | compute gen 55% | compute gen 77% | generated tokens | "
            "steps |",
            "|---|---|---|---|---|---|---|---|",
        ]
        arms = [a for a in ARM_ORDER if a in res["arms"]]
        for arm in arms:
            a = res["arms"][arm]
            for f in FRACTIONS:
                lines.append(
                    f"| {arm} | {int(f * 100)}% | {a[f'reached_{f}']}/{a['n']} | "
                    + " | ".join(_fmt(a[f"ratio_compute_{k}_{f}"]) for k in SPLIT_NAMES)
                    + f" | {_fmt(a[f'ratio_generated_tokens_{f}'])} | {_fmt(a[f'ratio_step_{f}'])} |"
                )
        lines += [
            "",
            "| arm | seeds | end − GRPO, equal compute CPU-like | gen 55% | gen 77% | zero-variance token share |",
            "|---|---|---|---|---|---|",
        ]
        for arm in ["grpo", *arms]:
            a = res["arms"][arm]
            lines.append(
                f"| {arm} | {a['n']} | "
                + " | ".join(_fmt(a[f"end_equal_compute_{k}_minus_grpo"], 3, True) for k in SPLIT_NAMES)
                + f" | {_fmt(a['zero_variance_share'])} |"
            )
        staged = [a for a in arms if res["arms"][a].get("brier", (None,))[0] is not None]
        if staged:
            lines += [
                "",
                "How well the history predicts zero-variance groups (last quarter of each run; Brier of the constant "
                "predictor at the observed share for comparison):",
                "",
                "| arm | predicted P(zero variance) | observed | Brier | Brier, base rate |",
                "|---|---|---|---|---|",
            ]
            for arm in staged:
                a = res["arms"][arm]
                lines.append(f"| {arm} | " + " | ".join(_fmt(a[k]) for k in PREDICTION_KEYS) + " |")
        for key, title in (
            ("both_vs_greso", "Both stages / the GRESO-style skip"),
            ("both_vs_default", "Both stages / today's default"),
            ("both_half_vs_default_half", "Both stages / the row stage alone, both at half the prompts per step"),
        ):
            if res.get(key):
                lines += ["", f"{title}, compute to target (paired per seed):", ""]
                lines += ["| target | CPU-like | gen 55% | gen 77% |", "|---|---|---|---|"]
                for f in FRACTIONS:
                    cells_ = " | ".join(_fmt(res[key][f"{k}_{f}"]) for k in SPLIT_NAMES)
                    lines.append(f"| {int(f * 100)}% | {cells_} |")
        goals = res["goals"]
        lines += ["", "Goals (issue 34):", ""]
        if "status" in goals:
            lines.append(f"- {goals['status']}")
        else:
            for key, g in goals.items():
                value = g.get("ratio", g.get("delta"))
                lines.append(f"- {key}: {_fmt(value, 3)} -> {'met' if g['met'] else 'NOT met'}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=os.path.join(common.ROOT, "outputs", "bench", "prompt_matrix"))
    p.add_argument("--cells", default="long_epochs,default_epochs,default,long")
    p.add_argument("--out", default=os.path.join(common.RESULTS, "prompt_matrix"))
    args = p.parse_args(argv)
    cells = {}
    for cell in args.cells.split(","):
        rec_path = os.path.join(args.root, "cells", f"{cell}.json")
        if not os.path.exists(rec_path):
            cells[cell] = {"status": "not run"}
            continue
        with open(rec_path, encoding="utf-8") as fh:
            rec = json.load(fh)
        if rec.get("runs") is None:
            tries = rec.get("tries", [])
            desc = "; ".join(
                f"pool {t['pool']} x {t['steps']} steps: revisits {t['revisits']:.0f}, share "
                f"{t['zero_variance_share_last_quarter']:.3f}"
                for t in tries
            )
            cells[cell] = {"status": f"no candidate has the property ({desc})", "record": rec}
            continue
        cells[cell] = {**analyse(rec["runs"], rec.get("kind", "epochs")), "record": rec}
    command = " ".join(["python benchmarks/prompt_analysis.py", *(argv if argv is not None else sys.argv[1:])])
    md = markdown(cells, command)
    with open(args.out + ".json", "w", encoding="utf-8") as fh:
        json.dump({"command": command, "cells": cells}, fh, indent=1, default=str)
    with open(args.out + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    print(md)
    return cells


if __name__ == "__main__":
    main()
