"""Analysis of `regime_matrix.py`'s runs: each cell's measured properties, each arm's cost to the target and end
accuracy at GRPO's compute, and the decision rule of issue 26 applied per compute split.

Per cell: start accuracy, GRPO's gain (bootstrap 95% interval over seeds), the target (start + 80% of GRPO's mean
gain, only when the gain's interval is above 0), the informative-row share (1 − TRL's ``frac_reward_zero_std``) at
the first step and over GRPO's run, GRPO's measured update share (the cell's CPU-like split), and the cell's own
property (late: the checkpoint's share; variance: GRPO-half's loss of gain). Per arm, paired with the same seed's GRPO
run: steps / generated tokens / policy tokens to the target, compute to the target under each split (`compute.py`,
baseline-step units), end accuracy at equal compute (last 3 evaluations within GRPO's compute under that split) and at
equal steps (last 3 evaluations within GRPO's steps), all against GRPO with bootstrap 95% intervals.

Decision (`decide`), per split: a setting passes a cell when every seed reached the target (a cell without a target
makes no claim on reaching) and its mean end accuracy at equal compute is at least GRPO's − 0.01; the default is the
cheapest (geometric mean over cells of the compute-to-target ratio) among those passing every cell run; if none
does, the most conservative one that passes (`CONSERVATIVE_ORDER`), else none (GRPO's full batch).
"""

from __future__ import annotations

import json
import math
import os

import _common as common
import numpy as np
from regime_runs import CELLS, END_POINTS, grpo_split_weights, load_cell_runs
from token_efficiency import TARGET_FRACTION, bootstrap_ci, update_share

from trl_costaware.tracking.compare.compute import phase_step_cost

TOLERANCE = 0.01
MIN_SEEDS = 3  # fewer seeds in a cell: no claim there (the setting cannot pass it)
CONSERVATIVE_ORDER = ("cost_aware_0.5", "cost_aware_0.5_recenter", "cost_aware_auto", "cost_aware_auto_recenter")
CONSERVATIVE_ORDER += ("cost_aware_0.25",)
SPLIT_NAMES = ("cpu", "gpu", "gpu_gen77")
# Issue 25's rule prices the split it runs under: under each split the setting "cost_aware_compute" is the arm that
# priced that split (this machine's measured phase times for the CPU-like split, the token model at each GPU split).
PRICED = {
    rule: {"cpu": rule, "gpu": f"{rule}_gen55", "gpu_gen77": f"{rule}_gen77"}
    for rule in ("cost_aware_compute", "cost_aware_compute_cal")
}
PRICED_ARMS = {arm for by_split in PRICED.values() for arm in by_split.values()}
FIXED_FRACTIONS = ("cost_aware_0.5", "cost_aware_0.25", "cost_aware_0.75")


def _with_compute(run: dict, weights: dict) -> list[dict]:
    return [
        {**p, **{f"compute_{k}": w.compute(p["generated_tokens"], p["policy_tokens"]) for k, w in weights.items()}}
        for p in run["curve"]
    ]


def _reach(curve: list[dict], target: float | None, keys) -> dict | None:
    if target is None:
        return None
    for i, p in enumerate(curve):
        if p["heldout_acc"] >= target:
            if i == 0:
                return {k: p[k] for k in keys}
            q = curve[i - 1]
            f = (target - q["heldout_acc"]) / (p["heldout_acc"] - q["heldout_acc"])
            return {k: q[k] + f * (p[k] - q[k]) for k in keys}
    return None


def _end_within(curve: list[dict], key: str, limit: float) -> float | None:
    pts = [p for p in curve[1:] if p[key] <= limit * (1 + 1e-6)]
    return float(np.mean([p["heldout_acc"] for p in pts[-END_POINTS:]])) if pts else None


def analyse_cell(cell: str, root: str) -> dict:
    rec_path = os.path.join(root, "cells", f"{cell}.json")
    if not os.path.exists(rec_path):
        return {"cell": cell, "status": "not run"}
    with open(rec_path, encoding="utf-8") as fh:
        rec = json.load(fh)
    out = {"cell": cell, "testbed": CELLS[cell][0], "kind": CELLS[cell][1], "record": rec, "arms": {}}
    if rec.get("runs") is None:
        out["status"] = "no candidate has the property"
        return out
    runs = load_cell_runs(rec["runs"])
    grpo = runs.get("grpo", {})
    if not grpo:
        out["status"] = "no GRPO run finished"
        return out
    steps = next(iter(grpo.values()))["steps"]
    start = float(np.mean([r["heldout_acc_start"] for r in grpo.values()]))
    gains = [_end(r) - r["heldout_acc_start"] for r in grpo.values()]
    gain = bootstrap_ci(gains)
    target = start + TARGET_FRACTION * gain[0] if gain[1] is not None and gain[1] > 0 else None
    shares = [r.get("informative_shares") or [] for r in grpo.values()]
    u = [update_share(r) for r in grpo.values()]
    out.update(
        status="run",
        steps=steps,
        seeds=sorted(grpo),
        start_accuracy=start,
        grpo_gain=gain,
        target=target,
        informative_first_step=float(np.mean([s[0] for s in shares if s])) if any(shares) else None,
        informative_mean=float(np.mean([np.mean(s) for s in shares if s])) if any(shares) else None,
        grpo_update_share=float(np.mean([x for x in u if x is not None])) if any(x is not None for x in u) else None,
    )
    keys = ("step", "generated_tokens", "policy_tokens", "wall_s", *(f"compute_{k}" for k in SPLIT_NAMES))
    for arm, by_seed in runs.items():
        rows = []
        for s in sorted(by_seed):
            if s not in grpo:
                continue
            w = grpo_split_weights(grpo, s, steps)
            c, g = _with_compute(by_seed[s], w), _with_compute(grpo[s], w)
            hit, g_hit = _reach(c, target, keys), _reach(g, target, keys)
            run_steps = c[-1]["step"]
            row = {
                "seed": s,
                "steps_run": run_steps,
                "reached": hit is not None,
                "kept_token_fraction": (c[-1]["policy_tokens"] / run_steps) / (g[-1]["policy_tokens"] / steps),
                "update_share": update_share(by_seed[s]),
                "end_equal_steps": _end_within(c, "step", steps),
                "grpo_end": _end(grpo[s]),
            }
            matched = arm == "grpo" or (by_seed[s].get("key") or {}).get("budget") is not None
            for k in SPLIT_NAMES:  # arms not given GRPO's compute (GRPO-half, the property's arm): n/a
                row[f"end_equal_compute_{k}"] = (
                    None
                    if not matched
                    else _end_within(
                        c, f"compute_{k}", w[k].compute(g[-1]["generated_tokens"], g[-1]["policy_tokens"])
                    )
                )
                row[f"step_cost_{k}"] = w[k].compute(c[-1]["generated_tokens"], c[-1]["policy_tokens"]) / run_steps
            same_gen = abs((c[-1]["generated_tokens"] / run_steps) / (g[-1]["generated_tokens"] / steps) - 1) < 0.1
            if same_gen and row["update_share"] is not None and update_share(grpo[s]) is not None:
                row["step_cost_phase"] = phase_step_cost(row["update_share"], update_share(grpo[s]))
            if hit:
                row.update({f"to_target_{k}": v for k, v in hit.items()})
            if hit and g_hit:
                for k in keys:
                    if g_hit[k] > 0:
                        row[f"ratio_{k}"] = hit[k] / g_hit[k]
                if "step_cost_phase" in row:
                    row["ratio_compute_phase"] = row["ratio_step"] * row["step_cost_phase"]
            rows.append(row)
        a = {"n": len(rows), "reached": sum(r["reached"] for r in rows), "per_seed": rows}
        for k in ("kept_token_fraction", "update_share", "step_cost_phase", *(f"step_cost_{s}" for s in SPLIT_NAMES)):
            vals = [r[k] for r in rows if r.get(k) is not None]
            a[k] = float(np.mean(vals)) if vals else None
        for k in [*(f"ratio_{k}" for k in keys), "ratio_compute_phase"]:
            a[k] = bootstrap_ci([r[k] for r in rows if k in r])
        for k in ("end_equal_steps", *(f"end_equal_compute_{s}" for s in SPLIT_NAMES)):
            a[f"{k}_minus_grpo"] = bootstrap_ci([r[k] - r["grpo_end"] for r in rows if r[k] is not None])
        a["steps_run"] = float(np.mean([r["steps_run"] for r in rows])) if rows else None
        out["arms"][arm] = a
    return out


def _end(run):
    return float(np.mean([p["heldout_acc"] for p in run["curve"][1:]][-END_POINTS:]))


def _setting_arms(cells: list[dict], split: str) -> dict[str, str]:
    """Setting name → the arm whose runs stand for it under `split`: every arm as itself, except the priced arms of
    the "compute" rules, of which only the one that priced this split appears, under the rule's name."""
    arms = sorted({a for c in cells for a in c.get("arms", {}) if a not in ("grpo", "grpo_half")})
    out = {a: a for a in arms if a not in PRICED_ARMS}
    for rule, by_split in PRICED.items():
        if by_split[split] in arms:
            out[rule] = by_split[split]
    return out


def decide(cells: list[dict], split: str) -> dict:
    run = [c for c in cells if c.get("status") == "run"]
    sources = _setting_arms(run, split)
    arms = sorted(sources)
    table = {}
    for arm in arms:
        per = {}
        for c in run:
            a = c["arms"].get(sources[arm])
            if a is None or a["n"] == 0:
                per[c["cell"]] = {"status": "not run"}
                continue
            end = a[f"end_equal_compute_{split}_minus_grpo"]
            reach_ok = None if c["target"] is None else a["reached"] == a["n"]
            end_ok = end[0] is not None and end[0] >= -TOLERANCE
            noise = end[1] is not None and end[1] < -TOLERANCE <= end[2]
            ratio = a[f"ratio_compute_{split}"]
            claim = a["n"] >= MIN_SEEDS
            per[c["cell"]] = {
                "claim": claim,
                "n": a["n"],
                "reached": f"{a['reached']}/{a['n']}",
                "reach_ok": reach_ok,
                "end_minus_grpo": end,
                "end_ok": end_ok,
                "end_within_noise": noise,
                "compute_ratio": ratio,
                "passes": claim and end_ok and reach_ok is not False,
            }
        table[arm] = per
    cell_names = [c["cell"] for c in run]
    passing = [a for a in arms if all(table[a].get(c, {}).get("passes") for c in cell_names)]

    def ratio(a, c):
        """The setting's mean compute-to-target ratio in the cell, None where it did not run."""
        return (table[a].get(c, {}).get("compute_ratio") or (None,))[0]

    def cost(a):
        r = [ratio(a, c) for c in cell_names if ratio(a, c)]
        return math.exp(float(np.mean(np.log(r)))) if r else math.inf

    if passing:
        choice, how = min(passing, key=cost), "cheapest in compute to target among the settings passing every cell"
    else:
        ok = [a for a in CONSERVATIVE_ORDER if a in table and any(v.get("passes") for v in table[a].values())]
        choice = ok[0] if ok else None
        how = (
            "no setting passes every cell: the most conservative one that passes any"
            if ok
            else (f"none passes (a cell with fewer than {MIN_SEEDS} seeds of a setting makes no claim)")
        )
    # GRPO itself (every row kept) passes every cell at compute ratio 1: a choice dearer than that saves nothing.
    above_grpo = choice is not None and choice in passing and cost(choice) > 1.0
    favour = {}
    for c in cell_names:
        ok = [a for a in arms if table[a].get(c, {}).get("passes")]
        favour[c] = min(ok, key=lambda a: table[a][c]["compute_ratio"][0] or math.inf) if ok else None
    return {
        "split": split,
        "sources": sources,
        "goal": {rule: compute_goal(run, split, table, rule) for rule in PRICED if rule in table},
        "cells": cell_names,
        "cells_not_run": [c["cell"] for c in cells if c.get("status") != "run"],
        "table": table,
        "passing": passing,
        "choice": choice,
        "how": how,
        "favour": favour,
        "cost": {a: cost(a) for a in arms},
        "choice_costs_more_than_grpo": above_grpo,
        "cells_dearer_than_grpo": {a: [c for c in cell_names if (ratio(a, c) or 0) > 1.0] for a in arms},
    }


def compute_goal(run: list[dict], split: str, table: dict, rule: str) -> dict:
    """Issue 25's goal for the "compute" rule under `split`, per cell: it passes (reaches the target in every seed,
    ends at GRPO − 0.01 or above at equal compute), and its compute to the target is at most that of the cheapest
    fixed fraction that passes the cell: the paired per-seed ratio compute-rule / fixed (bootstrap 95% CI over seeds)
    and whether its mean is ≤ 1."""
    arm = PRICED[rule][split]
    out = {}
    for c in run:
        mine = table[rule].get(c["cell"], {})
        if mine.get("status") == "not run":
            out[c["cell"]] = {"status": "not run"}
            continue
        fixed = [f for f in FIXED_FRACTIONS if table.get(f, {}).get(c["cell"], {}).get("passes")]
        best = min(fixed, key=lambda f: table[f][c["cell"]]["compute_ratio"][0]) if fixed else None
        row = {"passes": mine["passes"], "best_fixed": best, "ratio_to_best_fixed": None, "cheaper_or_equal": None}
        if best is not None:
            ours = {p["seed"]: p.get(f"ratio_compute_{split}") for p in c["arms"][arm]["per_seed"]}
            theirs = {p["seed"]: p.get(f"ratio_compute_{split}") for p in c["arms"][best]["per_seed"]}
            pairs = [ours[s] / theirs[s] for s in sorted(ours) if ours[s] and theirs.get(s)]
            if pairs:
                row["ratio_to_best_fixed"] = bootstrap_ci(np.asarray(pairs, float))
                row["cheaper_or_equal"] = row["ratio_to_best_fixed"][0] <= 1.0
        row["met"] = bool(mine["passes"]) and row["cheaper_or_equal"] is not False
        out[c["cell"]] = row
    return {"cells": out, "met": all(v.get("met") for v in out.values() if v.get("status") != "not run")}


def _ci(t, fmt="{:+.3f}") -> str:
    if t is None or t[0] is None:
        return "n/a"
    return fmt.format(t[0]) if t[1] is None else f"{fmt.format(t[0])} [{fmt.format(t[1])}, {fmt.format(t[2])}]"


def markdown(res: dict) -> str:
    lines = [f"`{res['command']}`", ""]
    lines += ["Cells and their measured properties (from the cell's GRPO runs):", ""]
    lines += [
        "| cell | status | seeds | steps | start acc | GRPO gain | target | informative share, step 1 / mean"
        " | GRPO update share | cell property |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["cells"]:
        if c.get("status") != "run":
            lines.append(f"| {c['cell']} | {c['status']} | | | | | | | | {_property(c)} |")
            continue
        tgt = "none (gain not beyond noise)" if c["target"] is None else f"{c['target']:.3f}"
        inf = (
            "n/a"
            if c["informative_first_step"] is None
            else (f"{c['informative_first_step']:.2f} / {c['informative_mean']:.2f}")
        )
        us = "n/a" if c["grpo_update_share"] is None else f"{c['grpo_update_share']:.0%}"
        lines.append(
            f"| {c['cell']} | run | {len(c['seeds'])} | {c['steps']} | {c['start_accuracy']:.3f} | "
            f"{_ci(c['grpo_gain'])} | {tgt} | {inf} | {us} | {_property(c)} |"
        )
    for c in res["cells"]:
        if c.get("status") != "run":
            continue
        lines += [
            "",
            f"**{c['cell']}** (paired with GRPO's run of the same seed; ratio = arm / GRPO to the target, "
            "mean [bootstrap 95% CI]; Δ = arm − GRPO in held-out accuracy):",
            "",
        ]
        lines += [
            "| arm | seeds | reached | kept token fraction | steps run | steps | generated tokens | policy tokens"
            " | compute CPU-like | compute GPU (verl) | compute GPU (gen 77%) | compute, measured phases"
            " | Δ end, equal compute CPU-like | Δ end, equal compute GPU | Δ end, equal steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for arm, a in c["arms"].items():
            if arm == "grpo":
                continue
            f2 = "{:.2f}"
            lines.append(
                f"| {arm} | {a['n']} | {a['reached']}/{a['n']} | {_num(a['kept_token_fraction'])} | "
                f"{_num(a['steps_run'], '{:.0f}')} | {_ci(a['ratio_step'], f2)} | "
                f"{_ci(a['ratio_generated_tokens'], f2)} | {_ci(a['ratio_policy_tokens'], f2)} | "
                f"{_ci(a['ratio_compute_cpu'], f2)} | {_ci(a['ratio_compute_gpu'], f2)} | "
                f"{_ci(a['ratio_compute_gpu_gen77'], f2)} | {_ci(a['ratio_compute_phase'], f2)} | "
                f"{_ci(a['end_equal_compute_cpu_minus_grpo'])} | {_ci(a['end_equal_compute_gpu_minus_grpo'])} | "
                f"{_ci(a['end_equal_steps_minus_grpo'])} |"
            )
    for d in res["decisions"].values():
        lines += [
            "",
            f"Decision under the {d['split']} split: **{d['choice'] or 'no setting'}** ({d['how']}). "
            f"Cells: {', '.join(d['cells']) or 'none'}"
            + (f"; not run: {', '.join(d['cells_not_run'])}" if d["cells_not_run"] else "")
            + f". A setting with fewer than {MIN_SEEDS} seeds in a cell makes no claim there."
            + (
                f" **It costs more than GRPO itself** (geometric-mean compute {d['cost'][d['choice']]:.2f} > 1): under"
                " this split, keeping every row is cheaper over these cells."
                if d.get("choice_costs_more_than_grpo")
                else ""
            ),
            "",
        ]
        lines += [
            "| setting | " + " | ".join(d["cells"]) + " | geometric-mean compute ratio |",
            "|---|" + "---|" * (len(d["cells"]) + 1),
        ]
        for arm, per in d["table"].items():
            cells = []
            for cn in d["cells"]:
                v = per.get(cn, {"status": "not run"})
                if v.get("status") == "not run":
                    cells.append("not run")
                    continue
                mark = "pass" if v["passes"] else ("FAIL" if v["claim"] else f"no claim ({v['n']} seeds)")
                if v["end_within_noise"]:
                    mark += " (end within noise of the tolerance)"
                cells.append(
                    f"{mark}: reached {v['reached']}, Δ end {_ci(v['end_minus_grpo'])}, compute "
                    f"{_ci(v['compute_ratio'], '{:.2f}')}"
                )
            name = arm if d["sources"].get(arm, arm) == arm else f"{arm} (runs of {d['sources'][arm]})"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_num(d['cost'][arm], '{:.2f}')} |")
        dearer = {a: cs for a, cs in d.get("cells_dearer_than_grpo", {}).items() if cs}
        if dearer:
            lines += [
                "",
                "Cells where a setting costs more than GRPO to the target (mean compute ratio > 1): "
                + "; ".join(f"{a}: {', '.join(cs)}" for a, cs in dearer.items())
                + ".",
            ]
        lines.append("")
        lines.append("Cheapest passing setting per cell: " + ", ".join(f"{c}: {a}" for c, a in d["favour"].items()))
        for rule, goal in d.get("goal", {}).items():
            parts = []
            for cn, g in goal["cells"].items():
                if g.get("status") == "not run":
                    parts.append(f"{cn}: not run")
                    continue
                vs = (
                    "no fixed fraction passes"
                    if g["best_fixed"] is None
                    else f"{_ci(g['ratio_to_best_fixed'], '{:.2f}')} of {g['best_fixed']}'s compute"
                )
                parts.append(
                    f"{cn}: {'passes' if g['passes'] else 'FAILS'}, {vs} → {'met' if g['met'] else 'NOT met'}"
                )
            lines += [
                "",
                f"Issue 25's goal for {rule} under this split (passes, and at most the cheapest passing "
                f"fixed fraction's compute, paired by seed): **{'met' if goal['met'] else 'not met'}**. "
                + "; ".join(parts)
                + ".",
            ]
    return "\n".join(lines)


def _num(v, fmt="{:.2f}"):
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def _property(c: dict) -> str:
    if c.get("status") == "not run":
        return "not run"
    rec = c.get("record") or {}
    if c.get("kind") == "late" and "checkpoint" in rec:
        k = rec["checkpoint"]
        return (
            f"checkpoint at GRPO step {k['step']}: held-out {k['heldout_acc']:.3f} (target {k['target']:.3f}), "
            f"informative share {k['informative_share']:.2f} (<= {k['informative_max']:.2f}: "
            f"{'yes' if k['property_holds'] else 'NO'})"
        )
    if c.get("kind") == "variance" and "tries" in rec:
        parts = []
        for t in rec["tries"]:
            loss = "n/a" if t["loss"] is None else f"{t['loss']:.0%}"
            lo, hi = t["loss_ci"]
            ci = "" if lo is None else f" [{lo:.0%}, {hi:.0%}]"
            parts.append(f"{t['prompts']} prompts, lr {t['learning_rate']:g}: GRPO-half loses {loss}{ci} of the gain")
        chosen = rec.get("chosen")
        return "; ".join(parts) + (f" → chosen: {chosen['tag']}" if chosen else " → none has the property")
    return "the testbed as it is"


def write_results(root: str, cells: list[str], tag: str, command: str, results_dir: str | None = None) -> dict:
    res = {"command": command, "cells": [analyse_cell(c, root) for c in cells]}
    res["decisions"] = {s: decide(res["cells"], s) for s in SPLIT_NAMES}
    res["markdown"] = markdown(res)
    results_dir = results_dir or common.RESULTS
    base = os.path.join(results_dir, tag)
    os.makedirs(results_dir, exist_ok=True)
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump({k: v for k, v in res.items() if k != "markdown"}, fh, indent=1, default=str)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(res["markdown"] + "\n")
    return res
