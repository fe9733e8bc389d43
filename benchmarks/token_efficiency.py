"""Benchmark 3: policy-optimisation tokens to reach GRPO's peak reward, Cost-Aware GRPO vs GRPO (embedded default).

    python benchmarks/token_efficiency.py --quick              # 2 seeds x 30 steps, main pair + uniform + filter
    python benchmarks/token_efficiency.py                      # full: 5 seeds x 80 steps, every suite
    python benchmarks/token_efficiency.py --suites main --seeds 5 --steps 80

Every arm runs the same number of steps on the same prompts (same seed, same rollouts budget: 16 prompts x 16
rollouts per step); the cost-aware arms train on a sample of each generation batch. Runs go two at a time (one per
core), the arms of one seed side by side. The reward curve is smoothed with a 10-point moving average
(`trl_costaware.compare`); the targets are the baseline arm's peak (mean curve over its seeds) and 99% of it.
Reported per arm: policy-optimisation tokens, generated tokens and wall time to each target and the saving against
the baseline; the same per seed against the same seed's baseline run (paired ratios, with their spread); held-out
accuracy (greedy and sampled at T=1, 256 problems) at the end.

Suites: main (dapo: grpo, cost_aware), filter (GRPO with zero-variance groups dropped), loss (grpo and cispo loss
types, both arms), ablations (dapo cost-aware variants: uniform proxy, smoothing alpha, multinomial draw, weight
normalisation, kept fraction).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402

SMOOTH = 10  # moving average over 10 logged steps
HELDOUT_SMOOTH = 3  # held-out accuracy (every 5 steps): moving average over 3 points
X_KEYS = {"policy": "cost_aware/policy_tokens", "generated": "cost_aware/generated_tokens", "wall": "wall_time"}

# label -> (trainer arm, settings on top of BASE_SETTINGS, suite, comparison group)
ARMS = {
    "grpo": ("grpo", {}, "main", "dapo"),
    "cost_aware": ("cost_aware", {}, "main", "dapo"),
    "grpo_zvfilter": ("grpo_zero_var_filter", {}, "filter", "dapo"),
    "ca_uniform": ("cost_aware", {"cost_aware_proxy": "uniform"}, "ablations", "dapo"),
    "ca_alpha0": ("cost_aware", {"cost_aware_smoothing": 0.0}, "ablations", "dapo"),
    "ca_alpha0.3": ("cost_aware", {"cost_aware_smoothing": 0.3}, "ablations", "dapo"),
    "ca_multinomial": ("cost_aware", {"cost_aware_draw": "multinomial"}, "ablations", "dapo"),
    "ca_selfnorm": ("cost_aware", {"cost_aware_weight_normalization": "self_normalize"}, "ablations", "dapo"),
    "ca_kept0.25": ("cost_aware", {"cost_aware_kept_fraction": 0.25}, "ablations", "dapo"),
    "ca_kept0.75": ("cost_aware", {"cost_aware_kept_fraction": 0.75}, "ablations", "dapo"),
    "grpo-Lgrpo": ("grpo", {"loss_type": "grpo"}, "loss", "grpo"),
    "cost_aware-Lgrpo": ("cost_aware", {"loss_type": "grpo"}, "loss", "grpo"),
    "grpo-Lcispo": ("grpo", {"loss_type": "cispo"}, "loss", "cispo"),
    "cost_aware-Lcispo": ("cost_aware", {"loss_type": "cispo"}, "loss", "cispo"),
}
BASELINES = {"dapo": "grpo", "grpo": "grpo-Lgrpo", "cispo": "grpo-Lcispo"}
MAIN_PLOT_ARMS = ("grpo", "cost_aware", "grpo_zvfilter", "ca_uniform")
QUICK_EXTRA = ("ca_uniform", "grpo_zvfilter")  # one seed each in --quick


def run_dir(root: str, label: str, seed: int) -> str:
    return os.path.join(root, f"{label}__s{seed}")


def build_specs(args) -> list[dict]:
    suites = set(args.suites.split(","))
    per_suite_seeds = {"main": args.seeds, "filter": args.filter_seeds, "loss": args.loss_seeds}
    per_suite_seeds["ablations"] = args.ablation_seeds
    specs = []
    for seed in range(max(per_suite_seeds.values())):  # seed-major: the arms of one seed run side by side
        for label, (arm, settings, suite, group) in ARMS.items():
            if args.quick:
                n = args.seeds if suite == "main" else (1 if label in QUICK_EXTRA else 0)
            else:
                n = per_suite_seeds[suite] if suite in suites else 0
            if seed < n:
                specs.append(
                    dict(
                        output_dir=run_dir(args.out, label, seed),
                        seed=seed,
                        steps=args.steps,
                        arm=arm,
                        settings=settings,
                        eval_n=args.eval_n,
                        heldout_every=args.heldout_every,
                        heldout_n=512,
                        heldout_sampled=args.heldout_sampled,
                        group=f"token_efficiency-{group}",
                    )
                )
    return specs


def step_rewards(run_dir_: str, metric: str = "reward") -> dict[int, float]:
    """Train reward per global step of a run (from its cost_aware_metrics.jsonl)."""
    out = {}
    with open(os.path.join(run_dir_, "cost_aware_metrics.jsonl"), encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row.get("split", "train") == "train" and metric in row:
                out[int(row["step"])] = float(row[metric])
    return out


def paired_step_difference(base_dir: str, arm_dir: str, steps: int, metric: str = "reward") -> float | None:
    """Mean over the second half of training of (arm reward − baseline reward) at equal steps: the two runs of one
    seed see the same prompts at the same step, so this removes the prompt-difficulty noise of the reward curve."""
    b, a = step_rewards(base_dir, metric), step_rewards(arm_dir, metric)
    common_steps = [s for s in a if s in b and s > steps // 2]
    if not common_steps:
        return None
    return sum(a[s] - b[s] for s in common_steps) / len(common_steps)


def has_metric(run_dir_: str, metric: str) -> bool:
    return bool(step_rewards(run_dir_, metric))


def analyse(root: str, steps: int, tag: str, metric: str = "reward", smooth: float = SMOOTH) -> dict:
    from trl_costaware.compare import compare_runs, format_report, load_runs, plot

    runs_by_label: dict[str, dict[int, str]] = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if "__s" not in name:
            continue
        label, seed = name.rsplit("__s", 1)
        d = os.path.join(root, name)
        res = common.load_result(d)
        if label in ARMS and res is not None and res["spec"]["steps"] == steps and has_metric(d, metric):
            runs_by_label.setdefault(label, {})[int(seed)] = d
    out = {"steps": steps, "metric": metric, "smoothing": smooth, "groups": {}}
    for group, base in BASELINES.items():
        labels = [lab for lab in ARMS if ARMS[lab][3] == group and lab in runs_by_label]
        if base not in labels or len(labels) < 2:
            continue
        dirs = [runs_by_label[lab][s] for lab in labels for s in sorted(runs_by_label[lab])]
        label_rules = [f"{lab}__s*={lab}" for lab in labels]
        g = {"baseline": base, "arms": {}, "reports": {}}
        for xname, xkey in X_KEYS.items():
            result = compare_runs(
                load_runs(dirs, progress=False),
                metric=metric,
                x=xkey,
                smoothing=smooth,
                labels=label_rules,
                baseline=base,
            )
            g["reports"][xname] = format_report(result)
            if xname == "policy":
                g["baseline_peak"] = result.baseline_peak
                main_labels = [lab for lab in labels if lab in MAIN_PLOT_ARMS]
                if len(labels) > len(main_labels) > 1:  # a readable figure with the main arms only
                    main_dirs = [runs_by_label[lab][s] for lab in main_labels for s in sorted(runs_by_label[lab])]
                    plot(
                        compare_runs(
                            load_runs(main_dirs, progress=False),
                            metric=metric,
                            x=xkey,
                            smoothing=smooth,
                            labels=[f"{lab}__s*={lab}" for lab in main_labels],
                            baseline=base,
                        ),
                        os.path.join(common.RESULTS, f"token_efficiency_{tag}_{group}_{metric}_main.png"),
                        title=f"{metric} vs policy-optimisation tokens ({group} loss, {steps} steps, MA {smooth:g})",
                    )
                plot(
                    result,
                    os.path.join(common.RESULTS, f"token_efficiency_{tag}_{group}_{metric}.png"),
                    title=f"{metric} vs policy-optimisation tokens ({group} loss, {steps} steps, MA {smooth:g})",
                )
            for a in result.arms:
                arm = g["arms"].setdefault(a["arm"], {"seeds": sorted(runs_by_label[a["arm"]])})
                arm[f"mean_curve_{xname}"] = {
                    "final": a["final"],
                    "peak": a["peak"],
                    "total": a["x_total"],
                    "targets": a["targets"],
                }
        # Paired per-seed savings: each run against the baseline run of the same seed.
        for lab in labels:
            arm = g["arms"][lab]
            paired = {xname: {1.0: [], 0.99: []} for xname in X_KEYS}
            reached = {1.0: 0, 0.99: 0}
            step_diffs = []
            finals, accs_g, accs_s, policy, generated, walls, kept = [], [], [], [], [], [], []
            per_seed = []
            for s, d in sorted(runs_by_label[lab].items()):
                res = common.load_result(d)
                accs_g.append(res.get("eval_greedy_acc"))
                accs_s.append(res.get("eval_sampled_acc"))
                policy.append(res["totals"]["policy_tokens"])
                generated.append(res["totals"]["generated_tokens"])
                walls.append(res["wall_train_s"])
                kept.append(res["totals"]["rows_kept"] / max(res["totals"]["rows_generated"], 1))
                row = {"seed": s, "dir": d}
                if lab != base and s in runs_by_label[base]:
                    pair = [runs_by_label[base][s], d]
                    step_diffs.append(paired_step_difference(runs_by_label[base][s], d, steps, metric))
                    row["reward_diff_2nd_half_equal_steps"] = step_diffs[-1]
                    for xname, xkey in X_KEYS.items():
                        r = compare_runs(
                            load_runs(pair, progress=False),
                            metric=metric,
                            x=xkey,
                            smoothing=smooth,
                            labels=[f"{base}__s*=base", f"{lab}__s*=arm"],
                            baseline="base",
                        )
                        a = next(a for a in r.arms if a["arm"] == "arm")
                        if xname == "policy":
                            finals.append(a["final_vs_baseline"])
                        for t in a["targets"]:
                            paired[xname][t["fraction"]].append(t["saving_pct"])
                            row[f"saving_{xname}_{t['fraction']:g}"] = t["saving_pct"]
                            if xname == "policy" and t["x"] is not None:
                                reached[t["fraction"]] += 1
                per_seed.append(row)
            arm["per_seed"] = per_seed
            arm["eval_greedy_acc"] = common.spread(accs_g)
            arm["eval_sampled_acc"] = common.spread(accs_s)
            arm["policy_tokens_total"] = common.spread(policy)
            arm["generated_tokens_total"] = common.spread(generated)
            arm["wall_train_s"] = common.spread(walls)
            arm["kept_row_fraction"] = common.spread(kept)
            if lab != base:
                arm["paired_final_minus_baseline"] = common.spread(finals)
                arm["paired_reward_diff_2nd_half"] = common.spread(step_diffs)
                arm["paired_reached"] = {f"{k:g}": v for k, v in reached.items()}
                arm["paired_saving_pct"] = {
                    xname: {f"{f:g}": common.spread(v) | {"raw": v} for f, v in d.items()}
                    for xname, d in paired.items()
                }
        out["groups"][group] = g
    return out


def summary_markdown(res: dict) -> str:
    lines = []
    for group, g in res["groups"].items():
        base = g["baseline"]
        lines += [
            f"### {res['metric']}, {group} loss — baseline `{base}`, {res['steps']} steps, MA {res['smoothing']:g} "
            "points, "
            f"baseline peak (mean curve) {g['baseline_peak']:.3f}",
            "",
            "Mean curve over seeds (saving vs the baseline arm's mean curve):",
            "",
            "| arm | seeds | kept rows | policy tokens total | final | peak | policy tok. to peak "
            "(saving) | to 99% (saving) | generated tok. saving to peak / 99% | wall saving to peak / 99% | "
            "greedy acc | sampled acc |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for lab, a in g["arms"].items():
            mc = a["mean_curve_policy"]
            t100, t99 = mc["targets"]
            gen = a["mean_curve_generated"]["targets"]
            wall = a["mean_curve_wall"]["targets"]

            def x_s(t):
                if t["x"] is None:
                    return "not reached"
                return f"{t['x']:,.0f}" + (f" ({t['saving_pct']:+.0f}%)" if t["saving_pct"] is not None else "")

            def s_only(t):
                return "n.r." if t["saving_pct"] is None else f"{t['saving_pct']:+.0f}%"

            lines.append(
                f"| {lab} | {len(a['seeds'])} | {a['kept_row_fraction']['mean']:.2f} | "
                f"{a['policy_tokens_total']['mean']:,.0f} | {mc['final']:.3f} | {mc['peak']:.3f} | {x_s(t100)} | "
                f"{x_s(t99)} | {s_only(gen[0])} / {s_only(gen[1])} | {s_only(wall[0])} / {s_only(wall[1])} | "
                f"{common.fmt_spread(a['eval_greedy_acc'], '{:.3f}')} | "
                f"{common.fmt_spread(a['eval_sampled_acc'], '{:.3f}')} |"
            )
        lines += [
            "",
            "Paired per seed (each run against the baseline run of the same seed; saving in %, mean ± std "
            "[min, max] over the seeds that reached the target; `reached` = seeds reaching it):",
            "",
            "| arm | reached peak / 99% | policy-token saving to peak | to 99% | generated-token saving to peak |"
            " wall saving to peak | final − baseline | − baseline at equal steps, 2nd half |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for lab, a in g["arms"].items():
            if lab == base:
                continue
            ps = a["paired_saving_pct"]
            n = len(a["per_seed"])
            lines.append(
                f"| {lab} | {a['paired_reached']['1']}/{n} , {a['paired_reached']['0.99']}/{n} | "
                f"{common.fmt_spread(ps['policy']['1'], '{:+.0f}')} | "
                f"{common.fmt_spread(ps['policy']['0.99'], '{:+.0f}')} | "
                f"{common.fmt_spread(ps['generated']['1'], '{:+.0f}')} | "
                f"{common.fmt_spread(ps['wall']['1'], '{:+.0f}')} | "
                f"{common.fmt_spread(a['paired_final_minus_baseline'], '{:+.3f}')} | "
                f"{common.fmt_spread(a['paired_reward_diff_2nd_half'], '{:+.3f}')} |"
            )
        lines.append("")
    return "\n".join(lines)


def compact_table(res: dict) -> str:
    """One line per arm: token ratio, paired equal-step differences (reward, held-out accuracy), targets reached,
    final held-out accuracy."""
    lines = [
        "| loss | arm | seeds | kept rows | policy tokens / GRPO | Δ reward at equal steps (2nd half) | "
        "Δ held-out acc at equal steps (2nd half) | seeds reaching GRPO peak / 99% (reward; held-out) | "
        "final greedy acc | final sampled acc |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rew, held = res["reward"]["groups"], res.get("heldout_acc", {}).get("groups", {})
    for group, g in rew.items():
        base_tokens = g["arms"][g["baseline"]]["policy_tokens_total"]["mean"]
        for lab, a in g["arms"].items():
            h = held.get(group, {}).get("arms", {}).get(lab)
            n = len(a["per_seed"])
            if lab == g["baseline"]:
                d_r = d_h = reach = "—"
            else:
                d_r = common.fmt_spread(a["paired_reward_diff_2nd_half"], "{:+.3f}")
                d_h = common.fmt_spread(h["paired_reward_diff_2nd_half"], "{:+.3f}") if h else "n/a"
                reach = f"{a['paired_reached']['1']}/{n}, {a['paired_reached']['0.99']}/{n}"
                if h:
                    reach += f"; {h['paired_reached']['1']}/{n}, {h['paired_reached']['0.99']}/{n}"
            lines.append(
                f"| {group} | {lab} | {n} | {a['kept_row_fraction']['mean']:.2f} | "
                f"{a['policy_tokens_total']['mean'] / base_tokens:.3f} | {d_r} | {d_h} | {reach} | "
                f"{common.fmt_spread(a['eval_greedy_acc'], '{:.3f}')} | "
                f"{common.fmt_spread(a['eval_sampled_acc'], '{:.3f}')} |"
            )
    return "\n".join(lines)


def write_csv(res: dict, path: str) -> None:
    keys = ["group", "arm", "seed", "dir"] + [f"saving_{x}_{f}" for x in X_KEYS for f in ("1", "0.99")]
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=keys + ["policy_tokens", "generated_tokens", "wall_train_s", "greedy_acc"])
        w.writeheader()
        for group, g in res["groups"].items():
            for lab, a in g["arms"].items():
                for row in a["per_seed"]:
                    r = common.load_result(row["dir"])
                    w.writerow(
                        {k: row.get(k) for k in keys if k in row}
                        | {
                            "group": group,
                            "arm": lab,
                            "policy_tokens": r["totals"]["policy_tokens"],
                            "generated_tokens": r["totals"]["generated_tokens"],
                            "wall_train_s": round(r["wall_train_s"], 2),
                            "greedy_acc": r.get("eval_greedy_acc"),
                        }
                    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 seeds x 30 steps, main pair + one seed of uniform/filter")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 80; quick 30)")
    p.add_argument("--seeds", type=int, default=None, help="seeds of the main pair (default 5; quick 2)")
    p.add_argument("--filter-seeds", type=int, default=3)
    p.add_argument("--loss-seeds", type=int, default=2)
    p.add_argument("--ablation-seeds", type=int, default=2)
    p.add_argument("--suites", default="main,filter,loss,ablations")
    p.add_argument("--eval-n", type=int, default=256, help="held-out problems for the final accuracy")
    p.add_argument(
        "--heldout-every", type=int, default=5, help="held-out greedy accuracy every N steps (512 problems)"
    )
    p.add_argument(
        "--heldout-sampled", action="store_true", help="also sampled (T=1) held-out accuracy, 1024 problems"
    )
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default=None, help="run folder (default outputs/bench/token_efficiency[_quick])")
    p.add_argument("--tag", default=None, help="results file name suffix (default quick / full)")
    p.add_argument("--analyze-only", action="store_true", help="only read the runs already in --out")
    args = p.parse_args(argv)
    tag = args.tag or ("quick" if args.quick else "full")
    args.steps = args.steps or (30 if args.quick else 80)
    args.seeds = args.seeds or (2 if args.quick else 5)
    args.out = args.out or os.path.join(common.ROOT, "outputs", "bench", f"token_efficiency_{tag}")
    os.makedirs(common.RESULTS, exist_ok=True)
    if not args.analyze_only:
        specs = build_specs(args)
        print(f"token_efficiency ({tag}): {len(specs)} runs of {args.steps} steps in {args.out}", flush=True)
        common.run_many(specs, jobs=args.jobs)
    res = {
        "command": " ".join(
            ["python", "benchmarks/token_efficiency.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "reward": analyse(args.out, args.steps, tag, "reward", SMOOTH),
        "heldout_acc": analyse(args.out, args.steps, tag, "heldout_acc", HELDOUT_SMOOTH),
    }
    if args.heldout_sampled:
        res["heldout_sampled_acc"] = analyse(args.out, args.steps, tag, "heldout_sampled_acc", HELDOUT_SMOOTH)
    base = os.path.join(common.RESULTS, f"token_efficiency_{tag}")
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1, default=str)
    write_csv(res["reward"], base + ".csv")
    md = f"`{res['command']}`\n\n### Summary (paired against the GRPO run of the same seed)\n\n" + compact_table(res)
    md += "\n\n" + "\n".join(summary_markdown(v) for k, v in res.items() if k != "command")
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(md)
    print(md)


if __name__ == "__main__":
    main()
