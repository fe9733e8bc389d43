"""The analysis of `real_model_learning.py`: curves, targets, costs to the target by seed, and the generation side.

    python benchmarks/real_model_learning.py --analyse              # reads <results>/runs/*.json
    python benchmarks/real_model_learning_analysis.py [RESULTS_DIR]  # the same

Writes ``summary.json``, ``summary.md`` and ``curves.png`` into the results folder. Plain functions on the run
records (`real_model_learning.train`'s result files):

- a curve point per evaluation: step, held-out score (T = 1) and greedy, cumulative policy and generated tokens,
  measured seconds (the step clock, evaluation excluded) and compute priced by a published GPU split in GRPO-step
  units (`trl_costaware.tracking.compare.compute.token_weights`, calibrated on the same seed's GRPO run);
- the target: the start score + a fraction (0.8, 0.5) of GRPO's mean gain at its last step; the cost to it is read
  on the curve by linear interpolation between evaluations (None: not reached);
- per arm, the ratio to GRPO of the same seed (steps, policy tokens, compute), Δ score at the end (equal steps) and
  at the arm's own final compute (GRPO's curve interpolated there), with a bootstrap interval over seeds (no
  interval below 3 seeds), and the largest fall of its score between evaluations;
- between each pair of non-GRPO arms, paired by seed: the difference of their ratios to GRPO (steps, compute) and
  of their final scores, with the same interval;
- from the GRPO runs' group log: the share of groups whose rewards are all equal (no gradient) and of the generated
  tokens they took, by step window; how well a prompt's earlier groups predict that its next one is such a group
  (ROC AUC, and the precision at the threshold that catches half of them).
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
RESULTS_DIR = os.path.join(HERE, "results", "real_model_learning")  # real_model_learning.py writes its runs here
TARGET_FRACTIONS = (0.8, 0.5)
SPLITS = ("gpu", "gpu_gen77")
BASELINE = "grpo"
BOOTSTRAP = 4000


# ====================================================================================================== curves
def load_runs(results: str) -> dict[tuple[str, int], dict]:
    runs = {}
    for path in sorted(glob.glob(os.path.join(results, "runs", "*.json"))):
        with open(path, encoding="utf-8") as fh:
            run = json.load(fh)
        runs[(run["arm"], int(run["seed"]))] = run
    return runs


def load_reevaluations(results: str) -> dict[str, dict]:
    """`real_model_learning.reevaluate`'s records, by run name."""
    found = {}
    for path in sorted(glob.glob(os.path.join(results, "reevaluations", "*.json"))):
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
        found[record["run"]] = record
    return found


def step_rate(run: dict) -> tuple[float, float]:
    """(generated, policy) tokens per step of a run, over all its steps."""
    last = run["steps"][-1]
    return last["generated_tokens"] / last["step"], last["policy_tokens"] / last["step"]


def curve(run: dict, weights: dict) -> list[dict]:
    """The run's evaluation points, step 0 first: step, score, greedy, policy_tokens, generated_tokens, seconds
    (cumulative step clock), gen_seconds, and ``compute_<split>`` for each priced split in `weights`."""
    base = run["base_eval"]
    zero = {"step": 0, "score": base["score"], "greedy": base["greedy"], "policy_tokens": 0.0}
    zero.update(generated_tokens=0.0, seconds=0.0, gen_seconds=0.0, **{f"compute_{k}": 0.0 for k in weights})
    points, seconds, gen_seconds = [zero], 0.0, 0.0
    for row in run["steps"]:
        seconds += row["step_s"]
        gen_seconds += row["gen_s"]
        if "eval" not in row:
            continue
        p = {
            "step": row["step"],
            "score": row["eval"]["score"],
            "greedy": row["eval"]["greedy"],
            "policy_tokens": row["policy_tokens"],
            "generated_tokens": row["generated_tokens"],
            "seconds": seconds,
            "gen_seconds": gen_seconds,
        }
        for name, w in weights.items():
            p[f"compute_{name}"] = w.compute(row["generated_tokens"], row["policy_tokens"])
        points.append(p)
    return points


def cost_to(points: list[dict], target: float, x: str) -> float | None:
    """The first `x` at which the curve reaches `target`, interpolated linearly between evaluations; None if never."""
    prev = None
    for p in points:
        if p["score"] >= target:
            if prev is None or p["score"] == prev["score"]:
                return p[x]
            t = (target - prev["score"]) / (p["score"] - prev["score"])
            return prev[x] + t * (p[x] - prev[x])
        prev = p
    return None


def value_at(points: list[dict], x: str, at: float) -> float | None:
    """The curve's score at `x` = `at`, interpolated linearly; None outside the curve."""
    for a, b in zip(points, points[1:], strict=False):
        if a[x] <= at <= b[x]:
            if b[x] == a[x]:
                return b["score"]
            return a["score"] + (at - a[x]) / (b[x] - a[x]) * (b["score"] - a["score"])
    return None


def interval(values: list[float], seed: int = 0) -> dict:
    """Mean and a 95% bootstrap interval over the values (seeds); no interval below 3 values."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    out = {"mean": sum(vals) / len(vals) if vals else None, "n": len(vals), "values": vals, "lo": None, "hi": None}
    if len(vals) >= 3:
        rng = random.Random(seed)
        means = sorted(sum(rng.choices(vals, k=len(vals))) / len(vals) for _ in range(BOOTSTRAP))
        out["lo"], out["hi"] = means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]
    return out


# ================================================================================================= generation side
def auc(scores: list[float], labels: list[int]) -> float | None:
    """ROC AUC (Mann-Whitney, ties count one half); None without both classes."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def precision_at_recall(scores: list[float], labels: list[int], recall: float = 0.5) -> dict | None:
    """Skip the groups scoring >= the threshold that first catches `recall` of the positives: the precision, and
    the share of all groups skipped."""
    total_pos = sum(labels)
    if not total_pos:
        return None
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    caught = 0
    for i in order:
        caught += labels[i]
        if caught >= recall * total_pos:
            threshold = scores[i]
            chosen = [j for j in order if scores[j] >= threshold]
            hit = sum(labels[j] for j in chosen)
            return {
                "precision": hit / len(chosen),
                "recall": hit / total_pos,
                "skipped_share": len(chosen) / len(scores),
            }
    return None


def no_gradient(group: dict) -> bool:
    return len(set(group["rewards"])) <= 1


def generation_side(runs: list[dict], window: int = 5) -> dict:
    """The GRPO runs' groups without gradient: shares by step window, and their predictability from the prompt's
    earlier groups in the same run. Two predictors: the share of the prompt's earlier groups without gradient, and
    p^G + (1 - p)^G with p the mean of their rewards (the chance that G Bernoulli(p) rewards are all equal)."""
    by_window: dict[int, dict] = {}
    share_scores, bern_scores, labels, tokens = [], [], [], []
    for run in runs:
        history: dict[tuple[int, int], list[dict]] = {}
        for g in sorted(run["groups"], key=lambda r: r["step"]):
            w = by_window.setdefault(
                (g["step"] - 1) // window, {"groups": 0, "flat": 0, "tokens": 0, "flat_tokens": 0}
            )
            flat = no_gradient(g)
            w["groups"] += 1
            w["flat"] += flat
            w["tokens"] += sum(g["tokens"])
            w["flat_tokens"] += flat * sum(g["tokens"])
            key = (g["a"], g["b"])
            earlier = history.setdefault(key, [])
            if earlier:
                n = len(g["rewards"])
                p = sum(sum(e["rewards"]) for e in earlier) / sum(len(e["rewards"]) for e in earlier)
                share_scores.append(sum(no_gradient(e) for e in earlier) / len(earlier))
                bern_scores.append(p**n + (1 - p) ** n)
                labels.append(int(flat))
                tokens.append(sum(g["tokens"]))
            earlier.append(g)
    windows = [
        {
            "steps": f"{k * window + 1}-{(k + 1) * window}",
            "groups": v["groups"],
            "no_gradient_share": v["flat"] / v["groups"],
            "no_gradient_token_share": v["flat_tokens"] / max(1, v["tokens"]),
        }
        for k, v in sorted(by_window.items())
    ]
    all_groups = sum(v["groups"] for v in by_window.values())
    return {
        "windows": windows,
        "no_gradient_share": sum(v["flat"] for v in by_window.values()) / max(1, all_groups),
        "no_gradient_token_share": sum(v["flat_tokens"] for v in by_window.values())
        / max(1, sum(v["tokens"] for v in by_window.values())),
        "predicted_groups": len(labels),
        "predicted_positive_share": sum(labels) / len(labels) if labels else None,
        "auc_earlier_share": auc(share_scores, labels) if labels else None,
        "auc_bernoulli": auc(bern_scores, labels) if labels else None,
        "at_half_recall_earlier_share": precision_at_recall(share_scores, labels) if labels else None,
        "at_half_recall_bernoulli": precision_at_recall(bern_scores, labels) if labels else None,
    }


# ====================================================================================================== the summary
def summarise(runs: dict[tuple[str, int], dict]) -> dict:
    from trl_costaware.tracking.compare.compute import SPLITS as SPLIT_TABLE
    from trl_costaware.tracking.compare.compute import token_weights

    arms = sorted({a for a, _ in runs}, key=lambda a: (a != BASELINE, a))
    base_seeds = sorted(s for a, s in runs if a == BASELINE)
    curves: dict[tuple[str, int], list[dict]] = {}
    for (arm, seed), run in runs.items():
        ref = runs.get((BASELINE, seed))
        weights = {}
        if ref is not None:
            gen, pol = step_rate(ref)
            weights = {name: token_weights(SPLIT_TABLE[name], gen, pol) for name in SPLITS}
        curves[(arm, seed)] = curve(run, weights)
    out: dict = {"arms": arms, "seeds": {a: sorted(s for b, s in runs if b == a) for a in arms}, "curves": {}}
    for (arm, seed), pts in curves.items():
        out["curves"][f"{arm}__s{seed}"] = pts
    if not base_seeds:
        return out
    start = sum(curves[(BASELINE, s)][0]["score"] for s in base_seeds) / len(base_seeds)
    end = sum(curves[(BASELINE, s)][-1]["score"] for s in base_seeds) / len(base_seeds)
    out["start"], out["grpo_end"] = start, end
    out["grpo_gain"] = interval(
        [curves[(BASELINE, s)][-1]["score"] - curves[(BASELINE, s)][0]["score"] for s in base_seeds]
    )
    out["grpo_end_greedy"] = interval([curves[(BASELINE, s)][-1]["greedy"] for s in base_seeds])
    out["start_greedy"] = curves[(BASELINE, base_seeds[0])][0]["greedy"]
    xs = ["step", "policy_tokens", "seconds"] + [f"compute_{k}" for k in SPLITS]
    out["targets"] = {}
    for frac in TARGET_FRACTIONS:
        target = start + frac * (end - start)
        table = {}
        for arm in arms:
            row = {}
            for x in xs:
                costs, ratios = {}, []
                for seed in out["seeds"][arm]:
                    c = cost_to(curves[(arm, seed)], target, x)
                    costs[seed] = c
                    if (BASELINE, seed) in curves:
                        b = cost_to(curves[(BASELINE, seed)], target, x)
                        ratios.append(c / b if c is not None and b else None)
                row[x] = {
                    "by_seed": costs,
                    "ratio": interval(ratios),
                    "not_reached": [s for s, c in costs.items() if c is None],
                }
            table[arm] = row
        out["targets"][f"{frac:g}"] = {"target": target, "arms": table}
    out["end"] = {}
    for arm in arms:
        d_steps, d_compute, d_seconds, ends = [], [], [], []
        for seed in out["seeds"][arm]:
            pts = curves[(arm, seed)]
            ends.append(pts[-1]["score"])
            ref = curves.get((BASELINE, seed))
            if ref is None:
                continue
            d_steps.append(pts[-1]["score"] - ref[-1]["score"])
            at = value_at(ref, "compute_gpu", pts[-1]["compute_gpu"])
            d_compute.append(None if at is None else pts[-1]["score"] - at)
            at = value_at(ref, "seconds", pts[-1]["seconds"])
            d_seconds.append(None if at is None else pts[-1]["score"] - at)
        gen = [sum(r["gen_s"] for r in runs[(arm, s)]["steps"]) for s in out["seeds"][arm]]
        step = [sum(r["step_s"] for r in runs[(arm, s)]["steps"]) for s in out["seeds"][arm]]
        n_steps = [len(runs[(arm, s)]["steps"]) for s in out["seeds"][arm]]
        out["end"][arm] = {
            "score": interval(ends),
            "greedy": interval([curves[(arm, s)][-1]["greedy"] for s in out["seeds"][arm]]),
            "delta_equal_steps": interval(d_steps),
            "delta_equal_compute_gpu": interval(d_compute),
            "delta_equal_seconds": interval(d_seconds),
            "largest_fall": interval([largest_fall(curves[(arm, s)]) for s in out["seeds"][arm]]),
            "step_s": sum(step) / sum(n_steps),
            "gen_s": sum(gen) / sum(n_steps),
            "update_share": (sum(step) - sum(gen)) / sum(step),
            "policy_tokens_per_step": interval([step_rate(runs[(arm, s)])[1] for s in out["seeds"][arm]]),
            "generated_tokens_per_step": interval([step_rate(runs[(arm, s)])[0] for s in out["seeds"][arm]]),
            "commits": sorted({runs[(arm, s)]["commit"] for s in out["seeds"][arm]}),
        }
    out["between_arms"] = between_arms(out, curves)
    eval_s = sum(r["eval"]["eval_s"] for run in runs.values() for r in run["steps"] if "eval" in r)
    train_s = sum(r["step_s"] for run in runs.values() for r in run["steps"])
    out["core_hours"] = {"train": train_s / 3600, "eval": eval_s / 3600, "total": (train_s + eval_s) / 3600}
    out["generation_side"] = generation_side([runs[(BASELINE, s)] for s in base_seeds])
    return out


def largest_fall(points: list[dict]) -> float:
    """The largest drop of the held-out score from one evaluation to a later one (0 if it never falls)."""
    best, fall = -math.inf, 0.0
    for p in points:
        best = max(best, p["score"])
        fall = max(fall, best - p["score"])
    return fall


def between_arms(s: dict, curves: dict) -> dict:
    """Each pair (a, b) of non-GRPO arms, paired by seed: b − a in the ratio to GRPO of steps and compute to each
    target, and in the score at the last step; negative cost differences mean b cost less."""
    arms = [a for a in s["arms"] if a != BASELINE]
    out = {}
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            seeds = sorted(set(s["seeds"][a]) & set(s["seeds"][b]))
            row: dict = {"seeds": seeds}
            for frac, t in s["targets"].items():
                for x in ("step", "compute_gpu", "compute_gpu_gen77"):
                    diffs = []
                    for seed in seeds:
                        ca, cb = t["arms"][a][x]["by_seed"][seed], t["arms"][b][x]["by_seed"][seed]
                        base = t["arms"][BASELINE][x]["by_seed"].get(seed) if BASELINE in t["arms"] else None
                        diffs.append((cb - ca) / base if None not in (ca, cb, base) and base else None)
                    row[f"{x}@{frac}"] = interval(diffs)
            row["end_score"] = interval([curves[(b, sd)][-1]["score"] - curves[(a, sd)][-1]["score"] for sd in seeds])
            out[f"{b} - {a}"] = row
    return out


# ====================================================================================================== report
def _iv(iv: dict, fmt: str = "{:.2f}") -> str:
    if iv["mean"] is None:
        return "—"
    vals = ", ".join(fmt.format(v) for v in iv["values"])
    if iv["lo"] is None:
        return f"{fmt.format(iv['mean'])} (seeds: {vals}; no interval)"
    return f"{fmt.format(iv['mean'])} [{fmt.format(iv['lo'])}, {fmt.format(iv['hi'])}]"


def report(s: dict) -> str:
    lines = ["# Learning benchmark on SmolLM2-135M-Instruct (times tables)", ""]
    lines.append("Command: `make bench-real-model-learning` (`python benchmarks/real_model_learning.py`); runs in")
    lines.append("`benchmarks/results/real_model_learning/runs/`; this file from `--analyse`.")
    lines.append("")
    lines.append("| arm | seeds |")
    lines.append("|---|---|")
    for arm in s["arms"]:
        lines.append(f"| {arm} | {', '.join(map(str, s['seeds'][arm]))} |")
    if "start" not in s:
        lines.append("\nNo GRPO run finished yet: no target.")
        return "\n".join(lines)
    lines += [
        "",
        f"Held-out score (T = 1) at the start {s['start']:.3f} (greedy {s['start_greedy']:.3f}); GRPO's gain to its "
        f"last step {_iv(s['grpo_gain'], '{:.3f}')}; greedy at the end {_iv(s['grpo_end_greedy'], '{:.3f}')}.",
        "",
    ]
    names = {"step": "steps", "policy_tokens": "policy tokens", "seconds": "CPU seconds"}
    names.update({f"compute_{k}": f"compute ({k})" for k in SPLITS})
    for frac, t in s["targets"].items():
        lines.append(f"## Cost to the target: start + {float(frac):.0%} of GRPO's gain (score {t['target']:.3f})")
        lines.append("")
        lines.append("Ratio to GRPO of the same seed (mean [95% bootstrap over seeds]); not reached: seeds that never")
        lines.append("reach it in the run.")
        lines.append("")
        lines.append("| arm | " + " | ".join(names[x] for x in names) + " | not reached |")
        lines.append("|---|" + "---|" * (len(names) + 1))
        for arm, row in t["arms"].items():
            cells = [_iv(row[x]["ratio"]) for x in names]
            nr = sorted(set(row["step"]["not_reached"]))
            lines.append(f"| {arm} | " + " | ".join(cells) + f" | {nr or '—'} |")
        lines.append("")
    lines.append("## End of the runs")
    lines.append("")
    lines.append(
        "| arm | score | greedy | Δ at equal steps | Δ at equal compute (gpu) | Δ at equal CPU seconds | "
        "largest fall | step s | generation s | update share | policy tokens / step | commits |"
    )
    lines.append("|---|" + "---|" * 11)
    for arm, e in s["end"].items():
        lines.append(
            f"| {arm} | {_iv(e['score'], '{:.3f}')} | {_iv(e['greedy'], '{:.3f}')} | "
            f"{_iv(e['delta_equal_steps'], '{:+.3f}')} | {_iv(e['delta_equal_compute_gpu'], '{:+.3f}')} | "
            f"{_iv(e['delta_equal_seconds'], '{:+.3f}')} | {_iv(e['largest_fall'], '{:.3f}')} | "
            f"{e['step_s']:.1f} | {e['gen_s']:.1f} | "
            f"{e['update_share']:.2f} | {e['policy_tokens_per_step']['mean']:.0f} | "
            f"{', '.join(c[:7] for c in e['commits'])} |"
        )
    lines.append("")
    lines.append("Largest fall: the largest drop of a run's score from one evaluation to a later one.")
    if s["between_arms"]:
        lines += ["", "## Between arms, paired by seed", ""]
        lines.append("b − a in the ratio to GRPO of the same seed (negative: b cost less), and in the score at the")
        lines.append("last step; mean [95% bootstrap over seeds].")
        lines.append("")
        measures = (("step", "steps"), ("compute_gpu", "compute (gpu)"), ("compute_gpu_gen77", "compute (gpu_gen77)"))
        cols = [(f"{x}@{f}", f"{n} to {float(f):.0%}") for f in s["targets"] for x, n in measures]
        lines.append("| b − a | seeds | " + " | ".join(n for _, n in cols) + " | score at the end |")
        lines.append("|---|---|" + "---|" * (len(cols) + 1))
        for pair, row in s["between_arms"].items():
            cells = [_iv(row[k], "{:+.2f}") for k, _ in cols] + [_iv(row["end_score"], "{:+.3f}")]
            lines.append(f"| {pair} | {', '.join(map(str, row['seeds']))} | " + " | ".join(cells) + " |")
    g = s["generation_side"]
    lines += ["", "## Generation side (GRPO runs)", ""]
    lines.append(
        f"Groups with every reward equal (no gradient): {g['no_gradient_share']:.2f} of groups, "
        f"{g['no_gradient_token_share']:.2f} of generated tokens."
    )
    lines.append("")
    lines.append("| steps | groups | no-gradient share | their token share |")
    lines.append("|---|---|---|---|")
    for w in g["windows"]:
        lines.append(
            f"| {w['steps']} | {w['groups']} | {w['no_gradient_share']:.2f} | {w['no_gradient_token_share']:.2f} |"
        )
    lines.append("")
    if g["predicted_groups"]:
        for key, label in (
            ("earlier_share", "share of earlier groups without gradient"),
            ("bernoulli", "p^G + (1-p)^G"),
        ):
            at = g[f"at_half_recall_{key}"]
            auc_v = g[f"auc_{key}"]
            lines.append(
                f"- predictor {label}: AUC {auc_v:.2f}" if auc_v is not None else f"- predictor {label}: AUC —"
            )
            if at:
                lines[-1] += (
                    f"; skipping the groups it ranks first until half the no-gradient ones are caught: precision "
                    f"{at['precision']:.2f}, {at['skipped_share']:.2f} of groups skipped"
                )
        lines.append(
            f"  ({g['predicted_groups']} groups whose prompt was seen earlier in the run; "
            f"{g['predicted_positive_share']:.2f} of them without gradient)"
        )
    if s.get("reevaluations"):
        lines += [
            "",
            "## End scores evaluated again",
            "",
            "A run's last checkpoint evaluated at more seeds (`--reevaluate K`): the recorded score is one draw.",
            "",
            "| run | step | recorded | again: mean [min, max] | seeds | recorded seed reproduced |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in sorted(s["reevaluations"].items()):
            lines.append(
                f"| {name} | {r['step']} | {r['recorded']['score']:.3f} | {r['score']:.3f} "
                f"[{min(r['scores']):.3f}, {max(r['scores']):.3f}] | {len(r['scores'])} | "
                f"{'yes' if r['reproduced'] else 'no'} |"
            )
    ch = s["core_hours"]
    lines += [
        "",
        f"Core-hours of the finished runs: {ch['total']:.1f} ({ch['train']:.1f} training, "
        f"{ch['eval']:.1f} evaluation).",
    ]
    return "\n".join(lines)


def plot(s: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [("compute_gpu", "compute, GRPO steps (GPU split, generation 55%)"), ("policy_tokens", "policy tokens"),
          ("seconds", "measured CPU seconds (training)")]  # fmt: skip
    fig, axes = plt.subplots(1, len(xs), figsize=(5 * len(xs), 4), sharey=True)
    colors = {}
    for ax, (x, label) in zip(axes, xs, strict=True):
        for arm in s["arms"]:
            color = colors.setdefault(arm, f"C{len(colors)}")
            seeds = s["seeds"][arm]
            per_seed = [s["curves"][f"{arm}__s{seed}"] for seed in seeds]
            for pts in per_seed:
                if pts and x in pts[0]:
                    ax.plot([p[x] for p in pts], [p["score"] for p in pts], color=color, alpha=0.25, lw=0.8)
            if per_seed and all(x in p[0] for p in per_seed):
                n = min(len(p) for p in per_seed)
                mx = [sum(p[i][x] for p in per_seed) / len(per_seed) for i in range(n)]
                my = [sum(p[i]["score"] for p in per_seed) / len(per_seed) for i in range(n)]
                ax.plot(mx, my, color=color, lw=2, marker="o", ms=3, label=f"{arm} ({len(seeds)} seeds)")
        for t in s.get("targets", {}).values():
            ax.axhline(t["target"], color="grey", ls=":", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out score (T = 1)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "SmolLM2-135M-Instruct, times tables, LoRA r 16, 8 prompts x 8, cap 64 (mean over seeds, thin: seeds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(results: str) -> dict:
    runs = load_runs(results)
    if not runs:
        raise SystemExit(f"no finished run in {os.path.join(results, 'runs')}")
    s = summarise(runs)
    s["reevaluations"] = load_reevaluations(results)
    with open(os.path.join(results, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(s, fh, indent=1)
    md = report(s)
    with open(os.path.join(results, "summary.md"), "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    plot(s, os.path.join(results, "curves.png"))
    print(md)
    return s


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", default=RESULTS_DIR, help="the results folder (default %(default)s)")
    analyse(parser.parse_args(argv).results)


if __name__ == "__main__":
    main()
