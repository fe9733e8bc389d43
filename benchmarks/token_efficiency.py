"""Benchmark 3 (and §5): policy-optimisation tokens (and wall time) to reach a fixed held-out target, on an embedded
testbed.

    python benchmarks/token_efficiency.py                  # default testbed: 10 seeds of GRPO, Cost-Aware 0.5 and
                                                           # uniform 0.5, 5 of the others
    python benchmarks/token_efficiency.py --testbed long   # the long testbed (adds full micro-batches as an arm)
    python benchmarks/token_efficiency.py --shard 0/2      # every 2nd run from the 1st: one process per core
    python benchmarks/token_efficiency.py --quick          # 2 seeds of GRPO and Cost-Aware 0.5, 30 steps
    python benchmarks/token_efficiency.py --smoke --out /tmp/te --results /tmp/te   # the machinery, ~1 min (its test)
    python benchmarks/token_efficiency.py --analyze-only   # re-read the runs already in --out
    python benchmarks/token_efficiency.py --compute-to-target   # compute to the target of the committed runs (§7)

The arms of a seed run one after the other, seed-major so that a partial run is usable: every run's result is
checkpointed (`outputs/bench/token_efficiency_<tag>/<arm>__s<seed>/run_result.json`) and the analysis is rewritten
after every run.

View A (same rollouts per step): GRPO, GRPO without zero-advantage rows (exact), uniform subsampling 0.5 / 0.25 (and
0.5 with recentred weights), PODS max-variance 0.5, Cost-Aware GRPO 0.25 / 0.5 / 0.75 (weights "none"), 0.25 and 0.5
with "recenter" weights and the loss-aware proxy (`MAIN_ARMS`, `OTHER_ARMS`, `KEPT_ARMS`; every one an arm of
`_common.ARMS`, checked before the first run). The committed results also hold arms of removed options (the `auto`
budget, `cost_aware_group_by_length`, full micro-batches): `--analyze-only` still reports them. View B (same policy
tokens per step): GRPO on half the prompts against Cost-Aware GRPO keeping half. Per arm also: real and padded policy
tokens, the update phase's share of a step, and the sampler's per-batch J ratios (`THEORY_KEYS`); the row rules are
compared pairwise on their common seeds (`PAIRS`).

Measured per run: held-out accuracy (512 fixed problems, one sample at T = 1) every 4 steps, with the policy tokens,
generated tokens and training wall seconds (evaluation excluded) at each point. The target is fixed once for all runs:
start + 80% of GRPO's mean improvement (improvement = mean of a run's last 3 evaluations − start). Per seed:
tokens / wall / steps to first reach it (linear interpolation between the two evaluations around the crossing);
paired ratios against the GRPO run of the same seed, mean with a bootstrap 95% interval over seeds; final accuracy
(last 3 evaluations) at equal steps and at equal policy tokens (GRPO's curve interpolated at the arm's tokens),
paired differences with intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402

from trl_costaware.scripts.demo import style_accuracy_axes  # noqa: E402
from trl_costaware.tracking.compare.compute import (  # noqa: E402
    GPU_GEN77,
    GPU_VERL,
    cpu_split,
    measured_update_share,
    phase_step_cost,
    token_weights,
)

MAIN_ARMS = ("grpo", "cost_aware_0.5", "uniform_0.5")  # --seeds (10)
# --other-seeds (5)
OTHER_ARMS = ("grpo_half", "zero_adv_filter", "pods_0.5", "cost_aware_0.5_recenter", "uniform_0.5_recenter")
OTHER_ARMS += ("cost_aware_0.5_loss_aware", "uniform_0.25")
KEPT_ARMS = ("cost_aware_0.25", "cost_aware_0.25_recenter", "cost_aware_0.75")  # --kept-seeds (5)
SMOKE_ARMS = ("grpo", "cost_aware_0.5")  # --smoke: 1 seed, 2 steps, 4 prompts x 8 rollouts
SMOKE_SETTINGS = {"per_device_train_batch_size": 32, "num_generations": 8}
SMOKE_EVAL_N = 32
VIEW_A = ("grpo", "zero_adv_filter", "uniform_0.5", "uniform_0.5_recenter", "uniform_0.25", "pods_0.5")
VIEW_A += ("cost_aware_0.25", "cost_aware_0.25_recenter", "cost_aware_0.5", "cost_aware_0.75")
VIEW_A += ("cost_aware_0.5_recenter", "cost_aware_auto")
VIEW_A += ("cost_aware_auto_recenter", "cost_aware_0.5_loss_aware", "cost_aware_0.5_group_by_length")
VIEW_A += ("cost_aware_0.5_full_micro", "cost_aware_auto_recenter_loss_aware")
VIEW_B = ("grpo_half", "cost_aware_0.5")
EVAL_GRID = 4  # the analysis reads every run's curve at steps 0, 4, 8, ... (runs evaluated more often included)
TARGET_FRACTION = 0.8
END_POINTS = 3
BOOTSTRAP = 10_000


# ==================================================================================================== running
def schedule(groups: list[tuple[tuple[str, ...], int]]) -> list[tuple[str, int]]:
    """(arm, seed) in run order from (arms, number of seeds) groups: seed-major, every arm of a seed together."""
    order = []
    for seed in range(max(n for _, n in groups)):
        order += [(a, seed) for arms, n in groups for a in arms if seed < n]
    return order


def load_runs(root: str, steps: int) -> dict[str, dict[int, dict]]:
    """arm -> seed -> run result, for the finished runs of `steps` steps under `root`."""
    runs: dict[str, dict[int, dict]] = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        path = os.path.join(root, name, "run_result.json")
        if "__s" not in name or not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            res = json.load(fh)
        if res["steps"] == steps:
            res["curve"] = [p for p in res["curve"] if p["step"] % EVAL_GRID == 0 or p["step"] == steps]
            runs.setdefault(res["arm"], {})[res["seed"]] = res
    return runs


# ==================================================================================================== statistics
def bootstrap_ci(values, level: float = 0.95, resamples: int = BOOTSTRAP, seed: int = 0):
    """(mean, low, high): percentile bootstrap interval of the mean over the values (None when empty)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if len(v) == 0:
        return None, None, None
    if len(v) == 1:
        return float(v[0]), None, None
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(resamples, len(v)))].mean(1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(v.mean()), float(lo), float(hi)


def end_acc(run: dict) -> float:
    """Mean held-out accuracy over the last `END_POINTS` evaluations (less noisy than the last one)."""
    return float(np.mean([p["heldout_acc"] for p in run["curve"][1:]][-END_POINTS:]))


def acc_at(run: dict, x: float, key: str = "policy_tokens", slack: float = 0.05) -> float | None:
    """Held-out accuracy of `run` interpolated at `key` = x; up to `slack` (5%) beyond its last point it is the last
    point's accuracy (two arms with the same tokens per step end a few % apart), further beyond None."""
    xs = np.array([p[key] for p in run["curve"]], dtype=float)
    ys = np.array([p["heldout_acc"] for p in run["curve"]], dtype=float)
    if x > xs[-1] * (1 + slack) + 1e-9:
        return None
    return float(np.interp(x, xs, ys))


def reach(run: dict, target: float | None) -> dict | None:
    """Where the held-out curve first reaches the target: step, policy tokens, generated tokens and wall seconds,
    linearly interpolated between the last evaluation below the target and the first at or above it (so the answer
    is not quantised to the evaluation grid). None if the curve never reaches it, or if there is no target."""
    if target is None:
        return None
    curve = run["curve"]
    for i, p in enumerate(curve):
        if p["heldout_acc"] >= target:
            if i == 0:
                return dict(p)
            q = curve[i - 1]
            f = (target - q["heldout_acc"]) / (p["heldout_acc"] - q["heldout_acc"])
            return {k: q[k] + f * (p[k] - q[k]) for k in ("step", "policy_tokens", "generated_tokens", "wall_s")}
    return None


def analyse(runs: dict[str, dict[int, dict]]) -> dict:
    grpo = runs.get("grpo", {})
    if not grpo:
        return {"error": "no finished GRPO run"}
    starts = {round(r["heldout_acc_start"], 6) for arm in runs.values() for r in arm.values()}
    start = float(np.mean([r["heldout_acc_start"] for r in grpo.values()]))
    improvements = [end_acc(r) - r["heldout_acc_start"] for r in grpo.values()]
    gain = bootstrap_ci(improvements)
    # No claim from noise: a target exists only when GRPO's improvement is above zero with 95% confidence over seeds.
    improved = gain[1] is not None and gain[1] > 0
    target = start + TARGET_FRACTION * gain[0] if improved else None
    out = {
        "start_accuracy": start,
        "distinct_start_accuracies": sorted(starts),
        "grpo_improvement": {"mean": gain[0], "ci95": gain[1:], "per_seed": improvements},
        "grpo_greedy_change": bootstrap_ci([r["greedy_acc_end"] - r["greedy_acc_start"] for r in grpo.values()]),
        "target": target,
        "target_rule": f"start + {TARGET_FRACTION:.0%} of GRPO's mean improvement (mean of the last {END_POINTS} "
        "evaluations − start)"
        if improved
        else "none: GRPO's improvement is not above zero with 95% confidence (bootstrap over seeds; at least 2 "
        "seeds), so no tokens-to-target is claimed",
        "arms": {},
    }
    for arm, by_seed in runs.items():
        base_arm = "grpo_half" if arm == "grpo_half" else "grpo"
        seeds = sorted(by_seed)
        a = {"seeds": seeds, "per_seed": []}
        ratios = {"policy_tokens": [], "wall_s": [], "step": [], "generated_tokens": []}
        d_steps, d_tokens, ends, gains = [], [], [], []
        for s in seeds:
            r = by_seed[s]
            hit = reach(r, target)
            g = grpo.get(s)
            g_hit = reach(g, target) if g else None
            row = {
                "seed": s,
                "end_acc": end_acc(r),
                "greedy_start": r["greedy_acc_start"],
                "greedy_end": r["greedy_acc_end"],
                "policy_tokens": r["totals"]["policy_tokens"],
                "policy_tokens_padded": r["totals"].get("policy_tokens_padded"),
                "generated_tokens": r["totals"]["generated_tokens"],
                "train_wall_s": r["train_wall_s"],
                "update_share": update_share(r),
                **{k: v for k, v in (r.get("batch_metrics") or {}).items()},
                "reached": hit is not None,
            }
            ends.append(row["end_acc"])
            gains.append(row["end_acc"] - r["heldout_acc_start"])
            if hit:
                row.update({f"to_target_{k}": hit[k] for k in ("step", "policy_tokens", "generated_tokens", "wall_s")})
            if g is not None and arm != "grpo":
                row["end_minus_grpo_equal_steps"] = row["end_acc"] - end_acc(g)
                d_steps.append(row["end_minus_grpo_equal_steps"])
                xs = [p["policy_tokens"] for p in r["curve"][1:]][-END_POINTS:]
                g_at = [acc_at(g, x) for x in xs]
                if all(v is not None for v in g_at):
                    row["end_minus_grpo_equal_tokens"] = row["end_acc"] - float(np.mean(g_at))
                    d_tokens.append(row["end_minus_grpo_equal_tokens"])
                if hit and g_hit:
                    for k in ratios:
                        if g_hit[k] > 0:
                            ratios[k].append(hit[k] / g_hit[k])
                            row[f"ratio_{k}"] = ratios[k][-1]
            a["per_seed"].append(row)
        n = len(seeds)
        a["reached"] = sum(r["reached"] for r in a["per_seed"])
        a["end_acc"] = bootstrap_ci(ends)
        a["gain"] = bootstrap_ci(gains)
        a["greedy_change"] = bootstrap_ci([r["greedy_end"] - r["greedy_start"] for r in a["per_seed"]])
        a["policy_tokens_total"] = float(np.mean([r["policy_tokens"] for r in a["per_seed"]]))
        a["train_wall_s"] = float(np.mean([r["train_wall_s"] for r in a["per_seed"]]))
        for key in ("policy_tokens_padded", "update_share", *THEORY_KEYS):
            vals = [r[key] for r in a["per_seed"] if r.get(key) is not None]
            a[key] = float(np.mean(vals)) if vals else None
        a["n"] = n
        del base_arm
        if arm != "grpo":
            a["paired_with_grpo"] = sum(1 for s in seeds if s in grpo)
            a["ratio_vs_grpo"] = {k: {"ci": bootstrap_ci(v), "n": len(v)} for k, v in ratios.items()}
            a["end_minus_grpo_equal_steps"] = bootstrap_ci(d_steps)
            a["end_minus_grpo_equal_tokens"] = bootstrap_ci(d_tokens)
        out["arms"][arm] = a
    if "grpo_half" in runs and "cost_aware_0.5" in runs:
        out["view_b"] = view_b(runs["grpo_half"], runs["cost_aware_0.5"], target)
    out["cost_aware_vs"] = {
        f"{arm} vs {other}": paired(runs[arm], runs[other], target)
        for arm, other in PAIRS
        if arm in runs and other in runs
    }
    return out


# The comparisons that say what the row choice adds: the method against plain subsampling at the same kept fraction
# and weights (uniform, PODS), against the exact zero-advantage filter, and its options against the default.
PAIRS = [("cost_aware_0.5", o) for o in ("zero_adv_filter", "pods_0.5", "uniform_0.5", "cost_aware_0.5_recenter")]
PAIRS += [("cost_aware_0.5_recenter", "uniform_0.5_recenter"), ("cost_aware_0.5_recenter", "pods_0.5")]
PAIRS += [("cost_aware_0.5_loss_aware", "cost_aware_0.5"), ("uniform_0.25", "uniform_0.5")]
PAIRS += [("cost_aware_0.5_recenter", "cost_aware_0.5")]  # an option against its default (RESULTS.md §4)
THEORY_KEYS = ("j_ratio_ideal", "j_ratio_achieved", "kept_token_fraction", "informative_fraction")


def update_share(run: dict) -> float | None:
    """The update phase's share of a training step's wall time: (training step − generation and scoring) / training
    step, summed over the run (`testbed._timed`; `compare.compute.measured_update_share`); None for runs recorded
    without the timers."""
    return measured_update_share(run.get("phase_s"))


def paired(arm: dict[int, dict], other: dict[int, dict], target: float) -> dict:
    """`arm` against `other` on their common seeds: ratio of policy tokens and of wall seconds to the target
    (arm / other), and the end-accuracy difference at equal steps (arm − other)."""
    seeds = sorted(set(arm) & set(other))
    tok, wall, d_end = [], [], []
    for s in seeds:
        a, b = reach(arm[s], target), reach(other[s], target)
        d_end.append(end_acc(arm[s]) - end_acc(other[s]))
        if a and b:
            tok.append(a["policy_tokens"] / b["policy_tokens"])
            wall.append(a["wall_s"] / b["wall_s"])
    return {
        "seeds": seeds,
        "ratio_policy_tokens": {"ci": bootstrap_ci(tok), "n": len(tok)},
        "ratio_wall": {"ci": bootstrap_ci(wall), "n": len(wall)},
        "end_difference_equal_steps": bootstrap_ci(d_end),
    }


def view_b(half: dict[int, dict], ca: dict[int, dict], target: float) -> dict:
    """Cost-Aware 0.5 (N rollouts, keeps N/2) against GRPO on N/2 rollouts, same seeds: end accuracy difference at
    equal steps (≈ equal policy tokens) and at equal policy tokens, and ratios of tokens / wall to the target."""
    seeds = sorted(set(half) & set(ca))
    d_end, d_tok, r_tok, r_wall, rows = [], [], [], [], []
    for s in seeds:
        h, c = half[s], ca[s]
        row = {"seed": s, "ca_end": end_acc(c), "half_end": end_acc(h)}
        d_end.append(row["ca_end"] - row["half_end"])
        xs = [p["policy_tokens"] for p in c["curve"][1:]][-END_POINTS:]
        h_at = [acc_at(h, x) for x in xs]
        if all(v is not None for v in h_at):
            row["ca_minus_half_equal_tokens"] = row["ca_end"] - float(np.mean(h_at))
            d_tok.append(row["ca_minus_half_equal_tokens"])
        hc, hh = reach(c, target), reach(h, target)
        row["ca_reached"], row["half_reached"] = hc is not None, hh is not None
        if hc and hh:
            r_tok.append(hc["policy_tokens"] / hh["policy_tokens"])
            r_wall.append(hc["wall_s"] / hh["wall_s"])
        rows.append(row)
    return {
        "seeds": seeds,
        "per_seed": rows,
        "ca_minus_half_end_equal_steps": bootstrap_ci(d_end),
        "ca_minus_half_end_equal_tokens": bootstrap_ci(d_tok),
        "ratio_policy_tokens_to_target": {"ci": bootstrap_ci(r_tok), "n": len(r_tok)},
        "ratio_wall_to_target": {"ci": bootstrap_ci(r_wall), "n": len(r_wall)},
        "ca_reached": sum(r["ca_reached"] for r in rows),
        "half_reached": sum(r["half_reached"] for r in rows),
    }


# ==================================================================================================== reporting
def _ci(t, fmt="{:+.3f}") -> str:
    mean, lo, hi = t if t is not None else (None, None, None)
    if mean is None:
        return "n/a"
    if lo is None:
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _num(v, fmt: str = "{:.3f}") -> str:
    return "—" if v is None else fmt.format(v)


def markdown(res: dict, command: str) -> str:
    if "error" in res:
        return res["error"]
    lines = [
        f"`{command}`",
        "",
        f"Start held-out accuracy {res['start_accuracy']:.3f} (every run starts from the same warm-up); GRPO's mean "
        f"improvement {_ci((res['grpo_improvement']['mean'], *res['grpo_improvement']['ci95']))} "
        f"(greedy change {_ci(res['grpo_greedy_change'])}); target "
        + (f"{res['target']:.3f} ({res['target_rule']})." if res["target"] is not None else f"{res['target_rule']}."),
        "",
        f"View A — same rollouts per step ({res.get('rollouts_per_step', '64 × 16')}). Ratios are arm / GRPO of the "
        "same seed, over the seeds where both reached the target (mean [bootstrap 95% CI]); Δ are paired differences "
        "in held-out accuracy.",
        "",
        "| arm | seeds | reached | policy tokens to target / GRPO | wall to target / GRPO | steps to target / GRPO"
        " | end acc (last 3 evals) | Δ end, equal steps | Δ end, equal policy tokens | greedy change | policy tokens"
        " total | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    arms = res["arms"]
    for arm in [a for a in VIEW_A if a in arms] + [a for a in arms if a not in VIEW_A]:
        a = arms[arm]
        if arm == "grpo":
            cells = ["1", "1", "1", "—", "—"]
        else:
            r = a["ratio_vs_grpo"]
            cells = [
                f"{_ci(r['policy_tokens']['ci'], '{:.2f}')} (n={r['policy_tokens']['n']})",
                _ci(r["wall_s"]["ci"], "{:.2f}"),
                _ci(r["step"]["ci"], "{:.2f}"),
                _ci(a["end_minus_grpo_equal_steps"]),
                _ci(a["end_minus_grpo_equal_tokens"]),
            ]
        lines.append(
            f"| {arm} | {a['n']} | {a['reached']}/{a['n']} | {cells[0]} | {cells[1]} | {cells[2]} | "
            f"{_ci(a['end_acc'], '{:.3f}')} | {cells[3]} | {cells[4]} | {_ci(a['greedy_change'])} | "
            f"{a['policy_tokens_total'] / 1e6:.2f}M | {a['train_wall_s']:.0f} |"
        )
    vs = res.get("cost_aware_vs")
    if vs:
        lines += [
            "",
            "The row rules against each other, paired on their common seeds (ratio = first / second arm, mean "
            "[95% CI]; Δ = first − second):",
            "",
            "| comparison | seeds | policy tokens to target, ratio | wall to target, ratio | Δ end acc., equal steps"
            " |",
            "|---|---|---|---|---|",
        ]
        for pair, v in vs.items():
            lines.append(
                f"| {pair} | {len(v['seeds'])} | {_ci(v['ratio_policy_tokens']['ci'], '{:.2f}')} | "
                f"{_ci(v['ratio_wall']['ci'], '{:.2f}')} | {_ci(v['end_difference_equal_steps'])} |"
            )
    lines += [
        "",
        "Cost and theory per arm (means over seeds): real and padded policy-optimisation tokens (padded = rows × "
        "width of the policy micro-batches), the update phase's share of a training step's wall time, and per "
        "generation "
        "batch (cost-aware arms only, from the sampler's log) the theory's best cost ratio of any row choice against "
        "uniform subsampling J(p*)/J(u) with G = |A|, the ratio of the arm's own distribution J(p)/J(u), the kept "
        "token fraction and the fraction of rows with A ≠ 0.",
        "",
        "| arm | policy tokens | padded | padded / real | update share of step | J(p*)/J(u) | J(p)/J(u) | kept token"
        " fraction | rows with A ≠ 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in [a for a in VIEW_A if a in arms] + [a for a in arms if a not in VIEW_A]:
        a = arms[arm]
        pad = a.get("policy_tokens_padded")
        cells = [
            f"{a['policy_tokens_total'] / 1e6:.3f}M",
            "n/a" if pad is None else f"{pad / 1e6:.3f}M",
            "n/a" if pad is None else f"{pad / a['policy_tokens_total']:.2f}",
            _num(a.get("update_share"), "{:.0%}"),
            *(_num(a.get(k)) for k in THEORY_KEYS),
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    vb = res.get("view_b")
    if vb:
        lines += [
            "",
            "View B — same policy tokens per step: Cost-Aware 0.5 (keeps half of the rollouts of View A) against GRPO "
            f"on half as many prompts, {len(vb['seeds'])} paired seeds.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| Δ end accuracy (CA − GRPO-half), equal steps | {_ci(vb['ca_minus_half_end_equal_steps'])} |",
            f"| Δ end accuracy, equal policy tokens | {_ci(vb['ca_minus_half_end_equal_tokens'])} |",
            f"| policy tokens to target, CA / GRPO-half (n={vb['ratio_policy_tokens_to_target']['n']}) | "
            f"{_ci(vb['ratio_policy_tokens_to_target']['ci'], '{:.2f}')} |",
            f"| wall to target, CA / GRPO-half (n={vb['ratio_wall_to_target']['n']}) | "
            f"{_ci(vb['ratio_wall_to_target']['ci'], '{:.2f}')} |",
            f"| reached target: CA / GRPO-half | {vb['ca_reached']}/{len(vb['seeds'])} , "
            f"{vb['half_reached']}/{len(vb['seeds'])} |",
        ]
    return "\n".join(lines)


def plot_curves(runs: dict[str, dict[int, dict]], arms, path: str, title: str, target: float | None) -> str | None:
    """Held-out accuracy against policy tokens: per arm the mean over seeds (interpolated on a common grid) with a
    ±1 standard-error band."""
    arms = [a for a in arms if a in runs]
    if not arms:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for arm in arms:
        curves = list(runs[arm].values())
        x_max = min(c["curve"][-1]["policy_tokens"] for c in curves)
        grid = np.linspace(0, x_max, 60)
        ys = np.array(
            [
                np.interp(grid, [p["policy_tokens"] for p in c["curve"]], [p["heldout_acc"] for p in c["curve"]])
                for c in curves
            ]
        )
        mean = ys.mean(0)
        se = ys.std(0, ddof=1) / np.sqrt(len(ys)) if len(ys) > 1 else np.zeros_like(mean)
        (line,) = ax.plot(grid / 1e6, mean, label=f"{arm} ({len(ys)} seeds)")
        ax.fill_between(grid / 1e6, mean - se, mean + se, color=line.get_color(), alpha=0.2)
    style_accuracy_axes(ax, target, "policy-optimisation tokens (millions)", title, legend_size=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ROLLOUTS_PER_STEP = {"default": "64 × 16", "long": "16 × 8"}


def write_results(
    root: str, steps: int, tag: str, command: str, testbed: str = "default", results: str = common.RESULTS
) -> dict:
    runs = load_runs(root, steps)
    res = analyse(runs)
    res["command"] = command
    res["steps"] = steps
    res["testbed"] = testbed
    res["rollouts_per_step"] = ROLLOUTS_PER_STEP[testbed]
    base = os.path.join(results, f"token_efficiency_{tag}")
    if "error" not in res:
        main = ("grpo", "zero_adv_filter", "pods_0.5", "uniform_0.5", "cost_aware_0.5")
        plot_curves(runs, main, base + "_view_a.png", f"View A: same rollouts per step ({steps} steps)", res["target"])
        plot_curves(
            runs,
            ("grpo", "cost_aware_0.25", "cost_aware_0.5", "cost_aware_0.75", "cost_aware_0.5_recenter"),
            base + "_kept.png",
            f"Cost-Aware GRPO: kept fraction and weights ({steps} steps)",
            res["target"],
        )
        plot_curves(
            runs,
            ("grpo_half", "cost_aware_0.5"),
            base + "_view_b.png",
            "View B: same policy tokens per step",
            res["target"],
        )
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(res, command) + "\n")
    return res


# =============================================================================================== compute to target
# What a run costs to the target, as a user pays it, from the committed runs of this benchmark (issue 26, item 3;
# `--compute-to-target`, RESULTS.md §1–3). Per arm and seed,
# paired with the same seed's GRPO run of the same results file: steps, generated tokens and policy tokens to the
# target (as `reach` interpolates them), and compute to the target in GRPO-step units
# (`trl_costaware.tracking.compare.compute`):
#
# - from tokens (device-free): w_gen · generated tokens + w_pol · policy tokens, the weights calibrated to the
#   same-seed GRPO run's tokens per step under a split: the testbed's CPU-like split (GRPO's measured update share,
#   no old/reference pass: β = 0 and one iteration per generation batch), verl's GPU split (generation 55%, old 11%,
#   reference 8%, update 26%; the passes scale with the kept rows, as `CostAwareGRPOTrainer` defers them there) and
#   the published upper end of the generation share (77%, the rest in verl's proportions);
# - from measured phases: steps ratio × (1 − u_GRPO) / (1 − u_arm), u = the run's update share of its training step
#   wall time; it assumes the same generation work per step, so it is n/a for GRPO on half the prompts; and the
#   measured wall-to-target ratio for reference (absolute seconds: noisy between runs on a shared machine).
#
# The break-even steps ratio 1 / c (c = the arm's step cost relative to GRPO's under the split) is the steps ratio
# above which the arm costs more than GRPO to the target. Arms with recentred weights from runs made before the
# recentring fix are left out (issue 26 item 1: weights centred at 1, which scales the gradient by N/|S|); the reruns
# after the fix (`token_efficiency_recenter_fix_<testbed>.json`, `--tag recenter_fix_<testbed>`) are read when present.
# Writes `benchmarks/results/compute_to_target.{md,json}`.
CT_FILES = {
    "default": ("token_efficiency_full_default.json", "token_efficiency_kept_default.json"),
    "long": ("token_efficiency_full_long.json", "token_efficiency_kept_long.json"),
}
# Runs made after the recentring fix (read when present): their recentred arms are used.
CT_POST_FIX = {tb: (f"token_efficiency_recenter_fix_{tb}.json",) for tb in CT_FILES}
CT_STEPS = 40
CT_SPLIT_KEYS = ("cpu", "gpu", "gpu_gen77")


def ct_excluded(arm: str, fname: str) -> str | None:
    """Why an arm's runs in a results file are not used (None: used)."""
    if "recenter" in arm and fname not in CT_POST_FIX_NAMES:
        return "recentred weights, run before the recentring fix: rerun after it (issue 26 item 1)"
    return None


CT_POST_FIX_NAMES = {n for names in CT_POST_FIX.values() for n in names}


def ct_arms_of(testbed: str) -> tuple[dict[str, tuple[dict, dict, str]], dict[str, str]]:
    """(arm -> (its entry, the GRPO entry of the same results file, the file), arm -> why left out): per arm the
    usable file with the most seeds (post-fix files when present)."""
    out: dict[str, tuple[dict, dict, str]] = {}
    left_out: dict[str, str] = {}
    names = [n for n in CT_FILES[testbed] + CT_POST_FIX[testbed] if os.path.exists(os.path.join(common.RESULTS, n))]
    for name in names:
        with open(os.path.join(common.RESULTS, name), encoding="utf-8") as fh:
            res = json.load(fh)
        grpo = res["arms"]["grpo"]
        for arm, entry in res["arms"].items():
            why = ct_excluded(arm, name)
            if why:
                left_out[arm] = why
            elif arm not in out or entry["n"] > out[arm][0]["n"]:
                out[arm] = (entry, grpo, name)
    return out, {a: w for a, w in left_out.items() if a not in out}


def ct_splits_for(grpo: dict) -> dict:
    u = float(np.mean([r["update_share"] for r in grpo["per_seed"] if r.get("update_share") is not None]))
    return {"cpu": cpu_split(u), "gpu": GPU_VERL, "gpu_gen77": GPU_GEN77}


def ct_analyse_arm(entry: dict, grpo: dict, splits: dict) -> dict:
    g_rows = {r["seed"]: r for r in grpo["per_seed"]}
    rows = []
    for r in entry["per_seed"]:
        g = g_rows.get(r["seed"])
        if g is None:
            continue
        row = {"seed": r["seed"], "reached": r["reached"], "end_minus_grpo": r["end_acc"] - g["end_acc"]}
        gen_ps, pol_ps = g["generated_tokens"] / CT_STEPS, g["policy_tokens"] / CT_STEPS
        f = (r["policy_tokens"] / CT_STEPS) / pol_ps
        row["kept_token_fraction"] = f
        for k, s in splits.items():
            w = token_weights(s, gen_ps, pol_ps)
            row[f"step_cost_{k}"] = w.compute(r["generated_tokens"] / CT_STEPS, r["policy_tokens"] / CT_STEPS)
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
    keys += [f"ratio_compute_{k}" for k in CT_SPLIT_KEYS] + [
        "end_minus_grpo",
        "kept_token_fraction",
        "step_cost_phase",
    ]
    keys += [f"{p}_{k}" for p in ("step_cost", "break_even") for k in CT_SPLIT_KEYS]
    for k in keys:
        a[k] = bootstrap_ci([r[k] for r in rows if r.get(k) is not None])
    return a


def compute_to_target() -> dict:
    out = {"testbeds": {}}
    for tb in CT_FILES:
        arms, left_out = ct_arms_of(tb)
        _, grpo, _ = arms["grpo"]
        splits = ct_splits_for(grpo)
        g_steps = bootstrap_ci([r["to_target_step"] for r in grpo["per_seed"] if r.get("reached")])
        t = {"splits": {k: s.__dict__ for k, s in splits.items()}, "grpo_steps_to_target": g_steps, "arms": {}}
        t["grpo_tokens_per_step"] = {
            "generated": float(np.mean([r["generated_tokens"] / CT_STEPS for r in grpo["per_seed"]])),
            "policy": float(np.mean([r["policy_tokens"] / CT_STEPS for r in grpo["per_seed"]])),
        }
        t["excluded"] = left_out
        for arm, (entry, g, fname) in arms.items():
            if arm == "grpo":
                continue
            t["arms"][arm] = {"file": fname, **ct_analyse_arm(entry, g, splits)}
        out["testbeds"][tb] = t
    return out


def _c2(t, fmt="{:.2f}") -> str:
    if t is None or t[0] is None:
        return "n/a"
    return fmt.format(t[0]) if t[1] is None else f"{fmt.format(t[0])} [{fmt.format(t[1])}, {fmt.format(t[2])}]"


def compute_to_target_markdown(res: dict) -> str:
    lines = ["`python benchmarks/token_efficiency.py --compute-to-target`", ""]
    for tb, t in res["testbeds"].items():
        sp = t["splits"]
        tok = t["grpo_tokens_per_step"]
        lines += [
            f"**{tb} testbed.** GRPO per step: {tok['generated']:,.0f} generated tokens, {tok['policy']:,.0f} policy "
            f"tokens; GRPO's steps to the target {_c2(t['grpo_steps_to_target'], '{:.1f}')}. Splits of GRPO's step "
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
                f"| {arm} | {a['n']} | {a['reached']}/{a['n']} | {_c2(a['kept_token_fraction'])} | "
                f"{_c2(a['ratio_step'])} | {_c2(a['ratio_generated_tokens'])} | {_c2(a['ratio_policy_tokens'])} | "
                f"{_c2(a['ratio_compute_cpu'])} | {_c2(a['break_even_cpu'])} | {_c2(a['ratio_compute_gpu'])} | "
                f"{_c2(a['break_even_gpu'])} | {_c2(a['ratio_compute_gpu_gen77'])} | "
                f"{_c2(a['break_even_gpu_gen77'])} | {_c2(a['ratio_compute_phase'])} | {_c2(a['ratio_wall_s'])} | "
                f"{_c2(a['end_minus_grpo'], '{:+.3f}')} |"
            )
        if t["excluded"]:
            lines += ["", "Left out: " + "; ".join(f"`{a}` ({why})" for a, why in t["excluded"].items()) + "."]
        lines.append("")
    return "\n".join(lines)


def write_compute_to_target(results: str = common.RESULTS) -> dict:
    res = compute_to_target()
    base = os.path.join(results, "compute_to_target")
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    md = compute_to_target_markdown(res)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    print(md)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 seeds of GRPO and Cost-Aware 0.5, 30 steps")
    p.add_argument(
        "--smoke", action="store_true", help="the machinery only: 1 seed of GRPO and Cost-Aware 0.5, 2 steps"
    )
    p.add_argument("--results", default=common.RESULTS, help="folder of the result files (default benchmarks/results)")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps per run (default {common.DEFAULT_STEPS})")
    p.add_argument("--seeds", type=int, default=10, help="seeds of GRPO and Cost-Aware 0.5")
    p.add_argument("--other-seeds", type=int, default=5, help="seeds of the baselines, GRPO-half and recenter")
    p.add_argument("--kept-seeds", type=int, default=5, help="seeds of Cost-Aware 0.25 and 0.75")
    p.add_argument("--eval-every", type=int, default=EVAL_GRID, help="held-out evaluation every N steps")
    p.add_argument("--out", default=None, help="run folder (default outputs/bench/token_efficiency_<tag>)")
    p.add_argument("--tag", default=None, help="results file name suffix (default full / quick)")
    p.add_argument("--analyze-only", action="store_true")
    p.add_argument("--testbed", default="default", choices=("default", "long"), help="embedded testbed")
    p.add_argument("--arms", default=None, help="comma-separated arms to run (default: all of the testbed's)")
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th run from the i-th (one process per core)")
    p.add_argument(
        "--compute-to-target",
        action="store_true",
        help="only the compute to the target of the committed runs (token_efficiency_{full,kept}_{default,long}.json)",
    )
    args = p.parse_args(argv)
    if args.compute_to_target:
        os.makedirs(args.results, exist_ok=True)
        write_compute_to_target(args.results)
        return
    from trl_costaware.embedded.testbed import get_testbed

    bed = get_testbed(args.testbed)
    kind = "smoke" if args.smoke else "quick" if args.quick else "full"
    tag = args.tag or kind + ("" if args.testbed == "default" else f"_{args.testbed}")
    steps = args.steps or (2 if args.smoke else 30 if args.quick else bed.steps)
    root = args.out or os.path.join(common.ROOT, "outputs", "bench", f"token_efficiency_{tag}")
    command = " ".join(["python benchmarks/token_efficiency.py", *(argv if argv is not None else sys.argv[1:])])
    os.makedirs(args.results, exist_ok=True)
    extra, eval_n = (SMOKE_SETTINGS, SMOKE_EVAL_N) if args.smoke else ({}, common.HELDOUT_N)
    if not args.analyze_only:
        if args.smoke:
            order = schedule([(SMOKE_ARMS, 1)])
        elif args.quick:
            order = schedule([(MAIN_ARMS, 2)])
        else:
            order = schedule([(MAIN_ARMS, args.seeds), (OTHER_ARMS, args.other_seeds), (KEPT_ARMS, args.kept_seeds)])
        common.checked_names("scheduled arms", ",".join(a for a, _ in order), common.ARMS)  # before hours of runs
        if args.arms:
            wanted = set(common.checked_names("--arms", args.arms, common.ARMS))
            order = [(a, s) for a, s in order if a in wanted]
        shard, shards = (int(x) for x in args.shard.split("/"))
        order = order[shard::shards]
        t0 = time.perf_counter()
        for i, (arm, seed) in enumerate(order):
            r = common.run_arm(
                arm,
                seed,
                root,
                steps=steps,
                eval_every=1 if args.smoke else args.eval_every,
                eval_n=eval_n,
                extra_settings=extra,
                testbed=args.testbed,
            )
            print(
                f"[{i + 1}/{len(order)}] {arm} seed {seed}: held-out {r['heldout_acc_start']:.3f} -> "
                f"{r['heldout_acc_end']:.3f}, train {r['train_wall_s']:.0f}s "
                f"(elapsed {time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
            write_results(root, steps, tag, command, args.testbed, args.results)
    res = write_results(root, steps, tag, command, args.testbed, args.results)
    print(markdown(res, command))


if __name__ == "__main__":
    main()
