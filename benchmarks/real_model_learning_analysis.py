"""The analysis of `real_model_learning.py`: curves, targets, costs to the target by seed, and the generation side.

    python benchmarks/real_model_learning.py --analyse              # reads <results>/runs/*.json
    python benchmarks/real_model_learning_analysis.py [RESULTS_DIR]  # the same
    python benchmarks/real_model_learning_analysis.py RESULTS_DIR --baseline grpo_shared  # ratios to another arm

Writes ``summary.json``, ``summary.md`` and ``curves.png`` into the results folder. Plain functions on the run
records (`real_model_learning.train`'s result files):

- a curve point per evaluation: step, held-out score (T = 1) and greedy, cumulative policy and generated tokens,
  measured seconds (the step clock, evaluation excluded), this process's CPU seconds where recorded (else the step
  clock), and compute priced by a published GPU split over the whole GRPO run (for Δ at equal compute);
- the target: the start score + a fraction (0.8, 0.5) of GRPO's mean gain at its last step (GRPO at the task's own
  batch, arm ``grpo``: 8 x 8 on times tables, 4 x 4 on the passage task); the cost to it is read on the curve by
  linear interpolation between evaluations (None: not reached);
- compute to the target in GRPO-step units (`price`): the generation share `s` of GRPO's step calibrated on the same
  seed's GRPO tokens per step up to its own crossing of the target, generation priced by the rows B generated per
  step as ∝ B^α (`trl_costaware.tracking.compare.compute`: α = 1 per generated token, α = 0 fixed per step,
  `PUBLISHED_ALPHA` PODS' curve), the rest per policy token;
- per arm, the ratio to GRPO of the same seed (steps, policy tokens, compute, CPU seconds), Δ score at the end
  (equal steps) and at the arm's own final compute (GRPO's curve interpolated there), and the largest fall of its
  score between evaluations; every mean comes with its per-seed values and a 95% Student-t interval over seeds (with
  3 seeds a percentile bootstrap is only their range);
- the frontier: each arm's compute to the target against GRPO's at its best batch (the GRPO arm that costs least at
  that pricing), for generation shares and α, the α at which the row stage and the smaller batch break even, and a
  figure (`frontier.png`);
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
import sys

from trl_costaware.tracking.compare.compute import PUBLISHED_ALPHA

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
RESULTS_DIR = os.path.join(HERE, "results", "real_model_learning")  # real_model_learning.py writes its runs here
TARGET_FRACTIONS = (0.8, 0.5)
SPLITS = ("gpu", "gpu_gen77")
BASELINE = "grpo"
GRPO_ARMS = ("grpo", "grpo_4x8", "grpo_8x4")  # GRPO at its batches: its best is the one that costs least
SHARED_GRPO_ARMS = ("grpo_shared", "grpo_shared_4x8")  # the same with each group's prompt run once in the update
ROW_STAGE, SMALLER_BATCHES = "loss_aware_0.5", ("grpo_4x8", "grpo_8x4")  # break-even α: the row stage vs each
FRONTIER_ALPHAS = (1.0, PUBLISHED_ALPHA, 0.0)  # per generated token; PODS' published curve; fixed per step
SWEEP_SHARES = tuple(i / 10 for i in range(11))  # the figure's generation shares
BREAK_EVEN_SHARES = (0.3, 0.55, 0.77)
# 95% two-sided Student-t quantiles by degrees of freedom (1.96 beyond 30)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
T95.update({k: v for k, v in zip(range(11, 31), (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093,
            2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042), strict=True)})  # fmt: skip


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


def rows_per_step(run: dict) -> float:
    """Rows generated per step: the run's shape (prompts x rollouts), else its counter."""
    shape = run.get("shape") or {}
    if shape.get("prompts") and shape.get("generations"):
        return float(shape["prompts"] * shape["generations"])
    last = run["steps"][-1]
    return last["rows_generated"] / last["step"]


def curve(run: dict, weights: dict) -> list[dict]:
    """The run's evaluation points, step 0 first: step, score, greedy, policy_tokens, generated_tokens, seconds
    (cumulative step clock), cpu_seconds (this process's CPU time where recorded, else the step clock), gen_seconds,
    and ``compute_<split>`` for each priced split in `weights`."""
    base = run["base_eval"]
    zero = {"step": 0, "score": base["score"], "greedy": base["greedy"], "policy_tokens": 0.0}
    zero.update(generated_tokens=0.0, seconds=0.0, cpu_seconds=0.0, gen_seconds=0.0)
    zero.update({f"compute_{k}": 0.0 for k in weights})
    points, seconds, cpu_seconds, gen_seconds = [zero], 0.0, 0.0, 0.0
    for row in run["steps"]:
        seconds += row["step_s"]
        cpu_seconds += row.get("cpu_s", row["step_s"])
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
            "cpu_seconds": cpu_seconds,
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


def interval(values: list[float]) -> dict:
    """Mean, the per-seed values and a 95% Student-t interval for the mean over them (mean ± t · sd / √n); no
    interval below 2 values. With 3 seeds a percentile bootstrap would be no more than their range."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    out = {"mean": sum(vals) / len(vals) if vals else None, "n": len(vals), "values": vals, "lo": None, "hi": None}
    if len(vals) >= 2:
        mean = out["mean"]
        sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        half = T95.get(len(vals) - 1, 1.96) * sd / math.sqrt(len(vals))
        out["lo"], out["hi"] = mean - half, mean + half
    return out


def excludes_zero(iv: dict) -> bool:
    """Whether the interval lies wholly on one side of 0 (a detectable difference)."""
    return iv["lo"] is not None and (iv["lo"] > 0 or iv["hi"] < 0)


# ====================================================================================================== pricing
def at_target(points: list[dict], target: float) -> dict | None:
    """Every cumulative quantity of the curve where it first reaches `target` (linear between evaluations)."""
    step = cost_to(points, target, "step")
    if step is None:
        return None
    return {x: cost_to(points, target, x) for x in points[0] if x not in ("score", "greedy")}


def price(cross: dict, ref: dict, rows: float, ref_rows: float, share: float, alpha: float) -> float | None:
    """Compute to the target in steps of the reference GRPO run (`ref`: its crossing, same seed), generation share
    `share` of its step calibrated on its tokens per step up to that crossing, generation ∝ B^α in the rows per step
    (`compute.token_weights`), the rest per policy token. The reference itself costs its steps."""
    from trl_costaware.tracking.compare.compute import Split, token_weights

    if ref["step"] <= 0 or ref["policy_tokens"] <= 0:  # the start already meets the target: nothing to price
        return None
    split = Split(share, 0.0, 1.0 - share)
    per_step = (ref["generated_tokens"] / ref["step"], ref["policy_tokens"] / ref["step"])
    weights = token_weights(split, *per_step, alpha=alpha, rows_per_step=ref_rows)
    return weights.compute(cross["generated_tokens"], cross["policy_tokens"], rows)


def frontier(
    runs: dict, curves: dict, target: float, shares: list[float], alphas: list[float], baseline: str = BASELINE
) -> dict:
    """For each generation share and α: every arm's compute to `target` per seed as a ratio to the `baseline` arm of
    the same seed, GRPO's best batch (the GRPO arm with the least mean ratio), and each arm's ratio to that batch."""
    arms = sorted({a for a, _ in runs}, key=lambda a: (a not in GRPO_ARMS, a))
    out = {}
    for share in shares:
        for alpha in alphas:
            key = f"s{share:g}_a{alpha:g}"
            table = {}
            for arm in arms:
                by_seed = {}
                for (a, seed), run in runs.items():
                    if a != arm or (baseline, seed) not in runs:
                        continue
                    ref = at_target(curves[(baseline, seed)], target)
                    cross = at_target(curves[(arm, seed)], target)
                    if ref is None or cross is None:
                        by_seed[seed] = None
                        continue
                    cost = price(cross, ref, rows_per_step(run), rows_per_step(runs[(baseline, seed)]), share, alpha)
                    by_seed[seed] = None if cost is None else cost / ref["step"]
                table[arm] = by_seed
            best = best_batch(table, GRPO_ARMS)
            best_shared = best_batch(table, SHARED_GRPO_ARMS)
            rows = {}
            for arm, by_seed in table.items():
                rows[arm] = {"by_seed": by_seed, "ratio": interval(list(by_seed.values())),
                             "vs_best_grpo": _paired_ratio(by_seed, table.get(best))}  # fmt: skip
                if best_shared is not None:
                    rows[arm]["vs_best_grpo_shared"] = _paired_ratio(by_seed, table[best_shared])
            out[key] = {"share": share, "alpha": alpha, "best_grpo": best, "best_grpo_shared": best_shared,
                        "arms": rows}  # fmt: skip
    return out


def best_batch(table: dict, family: tuple[str, ...]) -> str | None:
    """GRPO's best batch in `family`: the arm with the least mean ratio over the seeds in which every arm of the
    family that ran has reached the target; None when no arm of it ran or no seed is common."""
    arms = [a for a in family if a in table]
    if not arms:
        return None
    common = set.intersection(*({s for s, v in table[a].items() if v is not None} for a in arms))
    if not common:
        return None
    means = {a: sum(table[a][s] for s in common) / len(common) for a in arms}
    return min(means, key=means.get)


def _paired_ratio(by_seed: dict, best: dict | None) -> dict:
    """The interval of an arm's ratio over the best batch's, seed by seed (None where either did not reach)."""
    values = []
    for seed, v in by_seed.items():
        b = best.get(seed) if best is not None else None
        values.append(v / b if v is not None and b else None)
    return interval(values)


def break_even_alpha(
    runs: dict, curves: dict, target: float, share: float, a: str, b: str, baseline: str = BASELINE
) -> dict | None:
    """Where arms `a` and `b` cost the same (mean ratio to GRPO over their common seeds) at generation share `share`:
    ``{"alpha": α in [0, 1] by bisection on the sign of the difference, or None when one is cheaper at every α,
    "cheaper_below": the arm that costs less below that α (at every α when there is none)}``; None when an arm is
    missing."""

    def gap(alpha):
        t = frontier(
            {k: v for k, v in runs.items() if k[0] in (a, b, baseline)}, curves, target, [share], [alpha], baseline
        )
        row = next(iter(t.values()))["arms"]
        if a not in row or b not in row:
            return None
        seeds = [s for s in row[a]["by_seed"] if row[b]["by_seed"].get(s) is not None and row[a]["by_seed"][s]]
        if not seeds:
            return None
        return sum(row[a]["by_seed"][s] - row[b]["by_seed"][s] for s in seeds) / len(seeds)

    lo, hi = gap(0.0), gap(1.0)
    if lo is None or hi is None:
        return None
    cheaper = a if lo < 0 else b
    if lo * hi > 0:
        return {"alpha": None, "cheaper_below": cheaper}
    x0, x1 = 0.0, 1.0
    for _ in range(30):
        mid = (x0 + x1) / 2
        g = gap(mid)
        if (g < 0) == (lo < 0):
            x0 = mid
        else:
            x1 = mid
    return {"alpha": (x0 + x1) / 2, "cheaper_below": cheaper}


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
def summarise(runs: dict[tuple[str, int], dict], baseline: str = BASELINE) -> dict:
    """Every table and figure's numbers, each arm as a ratio to the `baseline` arm of the same seed."""
    from trl_costaware.tracking.compare.compute import SPLITS as SPLIT_TABLE
    from trl_costaware.tracking.compare.compute import token_weights

    arms = sorted({a for a, _ in runs}, key=lambda a: (a != baseline, a))
    base_seeds = sorted(s for a, s in runs if a == baseline)
    curves: dict[tuple[str, int], list[dict]] = {}
    for (arm, seed), run in runs.items():
        ref = runs.get((baseline, seed))
        weights = {}
        if ref is not None:
            gen, pol = step_rate(ref)
            weights = {name: token_weights(SPLIT_TABLE[name], gen, pol) for name in SPLITS}
        curves[(arm, seed)] = curve(run, weights)
    out: dict = {
        "baseline": baseline,
        "arms": arms,
        "seeds": {a: sorted(s for b, s in runs if b == a) for a in arms},
        "curves": {},
    }
    first = ([run for (arm, _), run in runs.items() if arm == baseline] or list(runs.values()))[0]
    shape = first.get("shape", {"prompts": 8, "generations": 8})
    out["task"] = first.get("task", "times_table")
    out["baseline_shape"] = f"{shape['prompts']} x {shape['generations']}"
    for (arm, seed), pts in curves.items():
        out["curves"][f"{arm}__s{seed}"] = pts
    if not base_seeds:
        return out
    start = sum(curves[(baseline, s)][0]["score"] for s in base_seeds) / len(base_seeds)
    end = sum(curves[(baseline, s)][-1]["score"] for s in base_seeds) / len(base_seeds)
    out["start"], out["grpo_end"] = start, end
    out["grpo_gain"] = interval(
        [curves[(baseline, s)][-1]["score"] - curves[(baseline, s)][0]["score"] for s in base_seeds]
    )
    out["grpo_end_greedy"] = interval([curves[(baseline, s)][-1]["greedy"] for s in base_seeds])
    out["start_greedy"] = curves[(baseline, base_seeds[0])][0]["greedy"]
    xs = ["step", "policy_tokens", "seconds", "cpu_seconds"] + [f"compute_{k}" for k in SPLITS]
    out["targets"] = {}
    for frac in TARGET_FRACTIONS:
        target = start + frac * (end - start)
        table = {}
        for arm in arms:
            row = {}
            for x in xs:
                costs, ratios = {}, []
                for seed in out["seeds"][arm]:
                    if x.startswith("compute_"):  # priced per token, calibrated on GRPO's steps up to the target
                        ref = at_target(curves[(baseline, seed)], target) if (baseline, seed) in curves else None
                        cross = at_target(curves[(arm, seed)], target)
                        share = SPLIT_TABLE[x[len("compute_") :]].generation
                        c = None
                        if ref is not None and cross is not None:  # a GRPO run of this seed, both at the target
                            rows, ref_rows = rows_per_step(runs[(arm, seed)]), rows_per_step(runs[(baseline, seed)])
                            c = price(cross, ref, rows, ref_rows, share, 1.0)
                        b = None if ref is None else ref["step"]
                    else:
                        c = cost_to(curves[(arm, seed)], target, x)
                        b = cost_to(curves[(baseline, seed)], target, x) if (baseline, seed) in curves else None
                    costs[seed] = c
                    if (baseline, seed) in curves:
                        ratios.append(c / b if c is not None and b else None)
                row[x] = {
                    "by_seed": costs,
                    "ratio": interval(ratios),
                    "not_reached": [s for s, c in costs.items() if c is None],
                }
            table[arm] = row
        out["targets"][f"{frac:g}"] = {"target": target, "arms": table}
    target = out["targets"][f"{TARGET_FRACTIONS[0]:g}"]["target"]
    out["frontier"] = frontier(
        runs, curves, target, [SPLIT_TABLE[k].generation for k in SPLITS], FRONTIER_ALPHAS, baseline
    )
    out["frontier_sweep"] = {
        key: {a: v["ratio"]["mean"] for a, v in t["arms"].items()}
        for key, t in frontier(runs, curves, target, SWEEP_SHARES, FRONTIER_ALPHAS, baseline).items()
    }
    out["break_even_alpha"] = {
        smaller: {
            f"{share:g}": break_even_alpha(runs, curves, target, share, ROW_STAGE, smaller, baseline)
            for share in BREAK_EVEN_SHARES
        }
        for smaller in SMALLER_BATCHES
    }
    out["end"] = {}
    for arm in arms:
        d_steps, d_compute, d_seconds, ends = [], [], [], []
        for seed in out["seeds"][arm]:
            pts = curves[(arm, seed)]
            ends.append(pts[-1]["score"])
            ref = curves.get((baseline, seed))
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
            "prompt_tokens": kept_prompt_tokens([runs[(arm, s)] for s in out["seeds"][arm]]),
        }
    out["between_arms"] = between_arms(out, curves)
    eval_s = sum(r["eval"]["eval_s"] for run in runs.values() for r in run["steps"] if "eval" in r)
    train_s = sum(r["step_s"] for run in runs.values() for r in run["steps"])
    out["core_hours"] = {"train": train_s / 3600, "eval": eval_s / 3600, "total": (train_s + eval_s) / 3600}
    out["generation_side"] = generation_side([runs[(baseline, s)] for s in base_seeds])
    return out


def kept_prompt_tokens(runs: list[dict]) -> dict | None:
    """What the draw keeps (the runs' ``draws`` logs): the mean prompt tokens of the kept rows and of all rows of
    the generation batches; None for runs without draws (GRPO, or runs logged before the draws were)."""
    kept, every = [], []
    for run in runs:
        for d in run.get("draws") or []:
            every += d["prompt_tokens"]
            kept += [d["prompt_tokens"][i] for i in d["kept"]]
    if not every or not kept:
        return None
    return {"kept": sum(kept) / len(kept), "batch": sum(every) / len(every), "kept_rows": len(kept)}


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
    baseline = s.get("baseline", BASELINE)
    arms = [a for a in s["arms"] if a != baseline]
    out = {}
    for i, a in enumerate(arms):
        for b in arms[i + 1 :]:
            seeds = sorted(set(s["seeds"][a]) & set(s["seeds"][b]))
            row: dict = {"seeds": seeds}
            for frac, t in s["targets"].items():
                for x in ("step", "cpu_seconds", "compute_gpu", "compute_gpu_gen77"):
                    diffs = []
                    for seed in seeds:
                        ca, cb = t["arms"][a][x]["by_seed"][seed], t["arms"][b][x]["by_seed"][seed]
                        base = t["arms"][baseline][x]["by_seed"].get(seed) if baseline in t["arms"] else None
                        diffs.append((cb - ca) / base if None not in (ca, cb, base) and base else None)
                    row[f"{x}@{frac}"] = interval(diffs)
            row["end_score"] = interval([curves[(b, sd)][-1]["score"] - curves[(a, sd)][-1]["score"] for sd in seeds])
            out[f"{b} - {a}"] = row
    return out


# ====================================================================================================== report
def _iv(iv: dict, fmt: str = "{:.2f}") -> str:
    """mean [95% t-interval] (the per-seed values)."""
    if iv["mean"] is None:
        return "—"
    vals = ", ".join(fmt.format(v) for v in iv["values"])
    if iv["lo"] is None:
        return f"{fmt.format(iv['mean'])} (one seed: no interval)"
    return f"{fmt.format(iv['mean'])} [{fmt.format(iv['lo'])}, {fmt.format(iv['hi'])}] ({vals})"


def baseline_name(s: dict) -> str:
    """How the report names the arm every ratio is taken to: "GRPO" for `grpo`, else the arm's name."""
    baseline = s.get("baseline", BASELINE)
    return "GRPO" if baseline == BASELINE else f"`{baseline}`"


def report(s: dict) -> str:
    task, shape = s.get("task", "times_table"), s.get("baseline_shape", "8 x 8")
    ref = baseline_name(s)
    folder = "real_model_learning" if task == "times_table" else f"real_model_learning_{task}"
    lines = [f"# Learning benchmark on SmolLM2-135M-Instruct (task {task})", ""]
    lines.append(f"Command: `python benchmarks/real_model_learning.py --task {task}`; runs in")
    lines.append(f"`benchmarks/results/{folder}/runs/`; this file from `--analyse`.")
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
        f"Held-out score (T = 1) at the start {s['start']:.3f} (greedy {s['start_greedy']:.3f}); {ref}'s gain to its "
        f"last step {_iv(s['grpo_gain'], '{:.3f}')}; greedy at the end {_iv(s['grpo_end_greedy'], '{:.3f}')}.",
        "",
    ]
    names = {"step": "steps", "policy_tokens": "policy tokens", "seconds": "step seconds",
             "cpu_seconds": "CPU seconds"}  # fmt: skip
    names.update({f"compute_{k}": f"compute ({k})" for k in SPLITS})
    for frac, t in s["targets"].items():
        lines.append(f"## Cost to the target: start + {float(frac):.0%} of {ref}'s gain (score {t['target']:.3f})")
        lines.append("")
        lines.append(
            f"Ratio to {ref} ({shape}) of the same seed: mean [95% t-interval over seeds] (per-seed values); not"
        )
        lines.append(
            "reached: seeds that never reach it in the run. Compute: generation priced per generated token at"
        )
        lines.append(f"the split's share of {ref}'s step, calibrated on its steps up to the target. CPU seconds: the")
        lines.append("run's own process time where recorded (one run per core), else the step clock.")
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
    kept = {arm: e["prompt_tokens"] for arm, e in s["end"].items() if e.get("prompt_tokens")}
    if kept:
        lines += ["", "What the draw keeps: mean prompt tokens of the kept rows against all rows of the batch.", ""]
        lines += ["| arm | kept rows | batch | ratio | kept rows counted |", "|---|---|---|---|---|"]
        for arm, k in kept.items():
            lines.append(
                f"| {arm} | {k['kept']:.0f} | {k['batch']:.0f} | {k['kept'] / k['batch']:.2f} | {k['kept_rows']} |"
            )
    if s["between_arms"]:
        lines += ["", "## Between arms, paired by seed", ""]
        lines.append(f"b − a in the ratio to {ref} of the same seed (negative: b cost less), and in the score at the")
        lines.append("last step; mean [95% t-interval over seeds] (per-seed values). An interval that contains 0 is")
        lines.append("no detectable difference.")
        lines.append("")
        measures = (("step", "steps"), ("cpu_seconds", "CPU seconds"), ("compute_gpu", "compute (gpu)"),
                    ("compute_gpu_gen77", "compute (gpu_gen77)"))  # fmt: skip
        cols = [(f"{x}@{f}", f"{n} to {float(f):.0%}") for f in s["targets"] for x, n in measures]
        lines.append("| b − a | seeds | " + " | ".join(n for _, n in cols) + " | score at the end |")
        lines.append("|---|---|" + "---|" * (len(cols) + 1))
        for pair, row in s["between_arms"].items():
            cells = [_iv(row[k], "{:+.2f}") for k, _ in cols] + [_iv(row["end_score"], "{:+.3f}")]
            lines.append(f"| {pair} | {', '.join(map(str, row['seeds']))} | " + " | ".join(cells) + " |")
    lines += frontier_report(s)
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


def frontier_report(s: dict) -> list[str]:
    """The frontier section: compute to the 80% target by pricing, against the baseline arm and GRPO's best batch."""
    if not s.get("frontier"):
        return []
    lines = ["", f"## The frontier: compute to start + {TARGET_FRACTIONS[0]:.0%} of GRPO's gain, by pricing", ""]
    shape, ref = s.get("baseline_shape", "8 x 8"), baseline_name(s)
    lines.append(f"Generation share s of {ref}'s ({shape}) step, calibrated on its steps up to the target; generation")
    lines.append("time ∝ (rows generated per step)^α (α = 1: per generated token; α = 0: fixed per step;")
    lines.append(f"{PUBLISHED_ALPHA:g}: PODS' published curve); the rest per policy token. Per arm: ratio to {ref}")
    lines.append(f"({shape}), and to GRPO at its best batch (the GRPO arm with the least mean ratio at that pricing),")
    lines.append("paired by seed: mean [95% t-interval] (per-seed values).")
    lines.append("")
    shared = any(t.get("best_grpo_shared") for t in s["frontier"].values())
    if shared:
        lines.append("With sharing: the same against GRPO with `shared_prompt_forward` at its best batch.")
        lines.append("")
    head = f"| pricing | GRPO's best batch | arm | ratio to {ref} {shape} | ratio to GRPO's best batch |"
    lines.append(head + (" GRPO with sharing's best | ratio to it |" if shared else ""))
    lines.append("|---|---|---|---|---|" + ("---|---|" if shared else ""))
    for t in s["frontier"].values():
        pricing = f"s {t['share']:.2f}, α {t['alpha']:g}"
        for arm, row in t["arms"].items():
            best, vs_best = t["best_grpo"] or "—", _iv(row["vs_best_grpo"])
            line = f"| {pricing} | {best} | {arm} | {_iv(row['ratio'])} | {vs_best} |"
            if shared:
                vs_shared = _iv(row.get("vs_best_grpo_shared") or interval([]))
                line += f" {t.get('best_grpo_shared') or '—'} | {vs_shared} |"
            lines.append(line)
    be = s.get("break_even_alpha", {})
    if be:
        lines.append("")
        lines.append(
            "\n".join(
                f"- where {ROW_STAGE} and {smaller} cost the same (mean over common seeds): {_break_even(v)}"
                for smaller, v in be.items()
            )
        )
    return lines


def _break_even(be: dict) -> str:
    """The break-even α by generation share, in words."""
    cells = []
    for share, v in be.items():
        if v is None:
            cells.append(f"s {share}: a run missing")
        elif v["alpha"] is None:
            cells.append(f"s {share}: {v['cheaper_below']} cheaper at every α")
        else:
            cells.append(f"s {share}: α = {v['alpha']:.2f} ({v['cheaper_below']} cheaper below)")
    return "; ".join(cells)


def plot_frontier(s: dict, path: str) -> None:
    """Compute to the target (ratio to GRPO `grpo`, mean over seeds) against the generation share, one panel per α,
    one line per arm; the break-even α of the row stage against the smaller batch in the titles' note."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = s.get("frontier_sweep") or {}
    if not sweep:
        return
    fig, axes = plt.subplots(1, len(FRONTIER_ALPHAS), figsize=(5 * len(FRONTIER_ALPHAS), 4), sharey=True)
    arms = sorted({a for v in sweep.values() for a in v}, key=lambda a: (a not in GRPO_ARMS, a))
    for ax, alpha in zip(axes, FRONTIER_ALPHAS, strict=True):
        for i, arm in enumerate(arms):
            xs, ys = [], []
            for share in SWEEP_SHARES:
                y = sweep.get(f"s{share:g}_a{alpha:g}", {}).get(arm)
                if y is not None:
                    xs.append(share)
                    ys.append(y)
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, color=f"C{i}", ls="--" if arm in GRPO_ARMS else "-", label=arm)
        for share in (0.55, 0.77):
            ax.axvline(share, color="grey", ls=":", lw=0.8)
        ax.axhline(1.0, color="black", lw=0.6)
        note = {1.0: "per generated token", 0.0: "fixed per step"}.get(alpha, "PODS' published curve")
        ax.set_title(f"α = {alpha:g} ({note})", fontsize=10)
        ax.set_xlabel("generation share of GRPO's step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"compute to {TARGET_FRACTIONS[0]:.0%} of the gain / {s.get('baseline', BASELINE)}'s")
    axes[0].legend(fontsize=7)
    lines = [f"{ROW_STAGE} vs {smaller}: {_break_even(v)}" for smaller, v in s.get("break_even_alpha", {}).items()]
    fig.suptitle("When the row stage pays (dashed: GRPO at its batches)\n" + "\n".join(lines), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(s: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [("compute_gpu", "compute, GRPO steps (GPU split, generation 55%)"), ("policy_tokens", "policy tokens"),
          ("cpu_seconds", "CPU seconds (training; process time where recorded)")]  # fmt: skip
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
        f"SmolLM2-135M-Instruct, task {s.get('task', 'times_table')}, LoRA r 16, cap 64; "
        f"{s.get('baseline_shape', '8 x 8')} unless the arm says (mean over seeds, thin: seeds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(results: str, baseline: str = BASELINE) -> dict:
    """Writes summary.{json,md}, curves.png and frontier.png in `results` (with another `baseline`, each name with
    ``_vs_<baseline>`` before its extension) and prints the summary."""
    runs = load_runs(results)
    if not runs:
        raise SystemExit(f"no finished run in {os.path.join(results, 'runs')}")
    if not any(arm == baseline for arm, _ in runs):
        raise SystemExit(f"--baseline {baseline}: no finished run of that arm in {os.path.join(results, 'runs')}")
    s = summarise(runs, baseline)
    s["reevaluations"] = load_reevaluations(results)
    suffix = "" if baseline == BASELINE else f"_vs_{baseline}"
    with open(os.path.join(results, f"summary{suffix}.json"), "w", encoding="utf-8") as fh:
        json.dump(s, fh, indent=1)
    md = report(s)
    with open(os.path.join(results, f"summary{suffix}.md"), "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    plot(s, os.path.join(results, f"curves{suffix}.png"))
    plot_frontier(s, os.path.join(results, f"frontier{suffix}.png"))
    print(md)
    return s


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", default=RESULTS_DIR, help="the results folder (default %(default)s)")
    parser.add_argument(
        "--baseline",
        default=BASELINE,
        help="the arm every ratio is taken to, seed by seed (default %(default)s; e.g. grpo_shared, whose runs are "
        "GRPO's trajectories at fewer tokens); files get a _vs_<arm> suffix",
    )
    args = parser.parse_args(argv)
    analyse(args.results, args.baseline)


if __name__ == "__main__":
    main()
