"""What a run costs to the target, as a user pays it, from the committed token-efficiency runs (issue 26, item 3).

    python benchmarks/compute_to_target.py      # reads token_efficiency_{full,kept}_{default,long}.json

Per arm and seed, paired with the same seed's GRPO run of the same results file: steps, generated tokens and policy
tokens to the target (as `token_efficiency.py` interpolates them), and compute to the target in GRPO-step units
(`trl_costaware.compare.compute`):

- **from tokens** (device-free): w_gen · generated tokens + w_pol · policy tokens, the weights calibrated to the
  same-seed GRPO run's tokens per step under a split: the testbed's CPU-like split (GRPO's measured update share,
  no old/reference pass: β = 0 and one iteration per generation batch), verl's GPU split (generation 55%, old 11%,
  reference 8%, update 26%; the passes scale with the kept rows, as `CostAwareGRPOTrainer` defers them there) and
  the published upper end of the generation share (77%, the rest in verl's proportions);
- **from measured phases**: steps ratio × (1 − u_GRPO) / (1 − u_arm), u = the run's update share of its training
  step wall time; it assumes the same generation work per step, so it is n/a for GRPO on half the prompts; and the
  measured wall-to-target ratio for reference (absolute seconds: noisy between runs on a shared machine).

The break-even steps ratio 1 / c (c = the arm's step cost relative to GRPO's under the split) is the steps ratio above
which the arm costs more than GRPO to the target. Arms with recentred weights from runs made before the recentring fix
are left out (issue 26 item 1: weights centred at 1, which scales the gradient by N/|S|); the reruns after the fix
(`token_efficiency_recenter_fix_<testbed>.json`, `--tag recenter_fix_<testbed>`) are read when present.
Writes `benchmarks/results/compute_to_target.{md,json}`.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
from token_efficiency import bootstrap_ci  # noqa: E402

from trl_costaware.compare.compute import (  # noqa: E402
    GPU_GEN77,
    GPU_VERL,
    cpu_split,
    phase_step_cost,
    token_weights,
)

FILES = {
    "default": ("token_efficiency_full_default.json", "token_efficiency_kept_default.json"),
    "long": ("token_efficiency_full_long.json", "token_efficiency_kept_long.json"),
}
# Runs made after the recentring fix (read when present): their recentred arms are used.
POST_FIX = {tb: (f"token_efficiency_recenter_fix_{tb}.json",) for tb in FILES}
STEPS = 40
SPLIT_KEYS = ("cpu", "gpu", "gpu_gen77")


def excluded(arm: str, fname: str) -> str | None:
    """Why an arm's runs in a results file are not used (None: used)."""
    if "recenter" in arm and fname not in POST_FIX_NAMES:
        return "recentred weights, run before the recentring fix: rerun after it (issue 26 item 1)"
    return None


POST_FIX_NAMES = {n for names in POST_FIX.values() for n in names}


def arms_of(testbed: str) -> tuple[dict[str, tuple[dict, dict, str]], dict[str, str]]:
    """(arm -> (its entry, the GRPO entry of the same results file, the file), arm -> why left out): per arm the
    usable file with the most seeds (post-fix files when present)."""
    out: dict[str, tuple[dict, dict, str]] = {}
    left_out: dict[str, str] = {}
    names = [n for n in FILES[testbed] + POST_FIX[testbed] if os.path.exists(os.path.join(common.RESULTS, n))]
    for name in names:
        with open(os.path.join(common.RESULTS, name), encoding="utf-8") as fh:
            res = json.load(fh)
        grpo = res["arms"]["grpo"]
        for arm, entry in res["arms"].items():
            why = excluded(arm, name)
            if why:
                left_out[arm] = why
            elif arm not in out or entry["n"] > out[arm][0]["n"]:
                out[arm] = (entry, grpo, name)
    return out, {a: w for a, w in left_out.items() if a not in out}


def splits_for(grpo: dict) -> dict:
    u = float(np.mean([r["update_share"] for r in grpo["per_seed"] if r.get("update_share") is not None]))
    return {"cpu": cpu_split(u), "gpu": GPU_VERL, "gpu_gen77": GPU_GEN77}


def analyse_arm(entry: dict, grpo: dict, splits: dict) -> dict:
    g_rows = {r["seed"]: r for r in grpo["per_seed"]}
    rows = []
    for r in entry["per_seed"]:
        g = g_rows.get(r["seed"])
        if g is None:
            continue
        row = {"seed": r["seed"], "reached": r["reached"], "end_minus_grpo": r["end_acc"] - g["end_acc"]}
        gen_ps, pol_ps = g["generated_tokens"] / STEPS, g["policy_tokens"] / STEPS
        f = (r["policy_tokens"] / STEPS) / pol_ps
        row["kept_token_fraction"] = f
        for k, s in splits.items():
            w = token_weights(s, gen_ps, pol_ps)
            row[f"step_cost_{k}"] = w.compute(r["generated_tokens"] / STEPS, r["policy_tokens"] / STEPS)
            row[f"break_even_{k}"] = 1.0 / row[f"step_cost_{k}"]
            if r.get("reached") and g.get("reached"):
                mine = w.compute(r["to_target_generated_tokens"], r["to_target_policy_tokens"])
                base = w.compute(g["to_target_generated_tokens"], g["to_target_policy_tokens"])
                row[f"compute_to_target_{k}"] = mine
                row[f"ratio_compute_{k}"] = mine / base
        if r.get("reached") and g.get("reached"):
            for k in ("step", "generated_tokens", "policy_tokens", "wall_s"):
                row[f"ratio_{k}"] = r[f"to_target_{k}"] / g[f"to_target_{k}"]
            row["to_target_step"] = r["to_target_step"]
            same_generation = abs(r["generated_tokens"] / g["generated_tokens"] - 1) < 0.1  # not GRPO-half
            if same_generation and r.get("update_share") is not None and g.get("update_share") is not None:
                row["step_cost_phase"] = phase_step_cost(r["update_share"], g["update_share"])
                row["ratio_compute_phase"] = row["ratio_step"] * row["step_cost_phase"]
        rows.append(row)
    a = {"n": len(rows), "reached": sum(r["reached"] for r in rows), "per_seed": rows}
    keys = ["ratio_step", "ratio_generated_tokens", "ratio_policy_tokens", "ratio_wall_s", "ratio_compute_phase"]
    keys += [f"ratio_compute_{k}" for k in SPLIT_KEYS] + ["end_minus_grpo", "kept_token_fraction", "step_cost_phase"]
    keys += [f"{p}_{k}" for p in ("step_cost", "break_even") for k in SPLIT_KEYS]
    for k in keys:
        a[k] = bootstrap_ci([r[k] for r in rows if r.get(k) is not None])
    return a


def analyse() -> dict:
    out = {"testbeds": {}}
    for tb in FILES:
        arms, left_out = arms_of(tb)
        _, grpo, _ = arms["grpo"]
        splits = splits_for(grpo)
        g_steps = bootstrap_ci([r["to_target_step"] for r in grpo["per_seed"] if r.get("reached")])
        t = {"splits": {k: s.__dict__ for k, s in splits.items()}, "grpo_steps_to_target": g_steps, "arms": {}}
        t["grpo_tokens_per_step"] = {
            "generated": float(np.mean([r["generated_tokens"] / STEPS for r in grpo["per_seed"]])),
            "policy": float(np.mean([r["policy_tokens"] / STEPS for r in grpo["per_seed"]])),
        }
        t["excluded"] = left_out
        for arm, (entry, g, fname) in arms.items():
            if arm == "grpo":
                continue
            t["arms"][arm] = {"file": fname, **analyse_arm(entry, g, splits)}
        out["testbeds"][tb] = t
    return out


def _ci(t, fmt="{:.2f}") -> str:
    if t is None or t[0] is None:
        return "n/a"
    return fmt.format(t[0]) if t[1] is None else f"{fmt.format(t[0])} [{fmt.format(t[1])}, {fmt.format(t[2])}]"


def markdown(res: dict) -> str:
    lines = ["`python benchmarks/compute_to_target.py`", ""]
    for tb, t in res["testbeds"].items():
        sp = t["splits"]
        tok = t["grpo_tokens_per_step"]
        lines += [
            f"**{tb} testbed.** GRPO per step: {tok['generated']:,.0f} generated tokens, {tok['policy']:,.0f} policy "
            f"tokens; GRPO's steps to the target {_ci(t['grpo_steps_to_target'], '{:.1f}')}. Splits of GRPO's step "
            f"(generation / old+ref passes / update): CPU-like {sp['cpu']['generation']:.0%} / "
            f"{sp['cpu']['passes']:.0%} / {sp['cpu']['update']:.0%} (measured), GPU (verl) 55% / 19% / 26%, "
            f"GPU (generation 77%) 77% / 10% / 13%. Per-token weights in GRPO-step units: w_gen = s_gen / "
            f"{tok['generated']:,.0f}, w_pol = (s_pass + s_upd) / {tok['policy']:,.0f}.",
            "",
            "| arm | seeds | reached | kept token fraction | steps to target / GRPO | generated tokens / GRPO | "
            "policy tokens / GRPO | compute CPU-like / GRPO | break-even CPU-like | compute GPU / GRPO | "
            "break-even GPU | compute GPU gen 77% / GRPO | break-even gen 77% | compute from phases / GRPO | "
            "wall / GRPO (measured) | Δ end acc, equal steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for arm, a in t["arms"].items():
            lines.append(
                f"| {arm} | {a['n']} | {a['reached']}/{a['n']} | {_ci(a['kept_token_fraction'])} | "
                f"{_ci(a['ratio_step'])} | {_ci(a['ratio_generated_tokens'])} | {_ci(a['ratio_policy_tokens'])} | "
                f"{_ci(a['ratio_compute_cpu'])} | {_ci(a['break_even_cpu'])} | {_ci(a['ratio_compute_gpu'])} | "
                f"{_ci(a['break_even_gpu'])} | {_ci(a['ratio_compute_gpu_gen77'])} | "
                f"{_ci(a['break_even_gpu_gen77'])} | {_ci(a['ratio_compute_phase'])} | {_ci(a['ratio_wall_s'])} | "
                f"{_ci(a['end_minus_grpo'], '{:+.3f}')} |"
            )
        if t["excluded"]:
            lines += ["", "Left out: " + "; ".join(f"`{a}` ({why})" for a, why in t["excluded"].items()) + "."]
        lines.append("")
    return "\n".join(lines)


def main():
    res = analyse()
    base = os.path.join(common.RESULTS, "compute_to_target")
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    md = markdown(res)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    print(md)
    return res


if __name__ == "__main__":
    main()
