"""Adaptive per-batch budget (`cost_aware_kept_fraction="auto"`) against fixed kept fractions and GRPO, on the testbed.

    python benchmarks/adaptive_budget.py --seeds 5            # auto at δ = 0.25, 0.5, 1 (+ recenter at 0.5)
    python benchmarks/adaptive_budget.py --analyze-only       # tables and plots from the finished runs

Each auto arm keeps, per generation batch, the smallest m whose predicted Horvitz–Thompson variance inflation
I(m) = Σ (1 − π_i)/π_i G_i² / Σ G_i² is at most δ (`trl_costaware.budget.smallest_budget`, docs/budget_and_proxy.md
§2). GRPO and the fixed-fraction arms (Cost-Aware 0.25 / 0.5 / 0.75) are the token-efficiency benchmark's runs
(`benchmarks/token_efficiency.py`, same testbed, seeds, prompts and steps), read from its run folder; a missing one
is run here with the same harness (`_common.run_arm`). Protocol as in the token-efficiency benchmark: target = start
+ 80% of GRPO's mean improvement in held-out accuracy; per seed, policy tokens to first reach it; paired per-seed
ratios against GRPO and against the best fixed fraction with percentile-bootstrap 95% intervals over seeds; final
accuracy (mean of the last 3 evaluations). The kept fraction m/N and the predicted inflation of every step come from
each run's metrics record (`cost_aware_metrics.jsonl`).
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
import token_efficiency as te  # noqa: E402

DELTAS = (0.25, 0.5, 1.0)
FIXED_ARMS = ("cost_aware_0.25", "cost_aware_0.5", "cost_aware_0.75")
RECENTER_DELTA = 0.5
METRICS_FILE = "cost_aware_metrics.jsonl"


def auto_arm_name(delta: float, normalization: str = "none", proxy: str = "advantage") -> str:
    name = f"auto_d{delta:g}" + ("" if normalization == "none" else f"_{normalization}")
    return name + ("_la" if proxy == "loss_aware" else "")


def extra_arms(runs: dict) -> list[str]:
    """The arms of this benchmark found among the runs: auto budgets and loss-aware-proxy arms."""
    return sorted(a for a in runs if a.startswith("auto_") or a.endswith("_la"))


def run_auto(
    delta: float, seed: int, root: str, steps: int, normalization: str = "none", proxy: str = "advantage"
) -> dict:
    """One auto-budget run: the trainer's own `cost_aware_kept_fraction="auto"` with `cost_aware_budget_delta`; a
    finished run is reused."""
    name = auto_arm_name(delta, normalization, proxy)
    settings = {"cost_aware_weight_normalization": normalization}
    if proxy != "advantage":
        settings["cost_aware_proxy"] = proxy
    native = {
        "trainer": "cost_aware",
        "settings": {**settings, "cost_aware_kept_fraction": "auto", "cost_aware_budget_delta": delta},
    }
    return common.run_arm(native, seed, root, name=name, steps=steps)


def step_series(run_dir: str) -> dict[str, list[float]]:
    """Per optimizer step, from the run's metrics record: kept row fraction and predicted inflation (if logged)."""
    path = os.path.join(run_dir, METRICS_FILE)
    out = {"step": [], "kept_fraction": [], "inflation": [], "informative": []}
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if "cost_aware/kept_row_fraction" not in row:
                continue
            out["step"].append(row.get("step"))
            out["kept_fraction"].append(row["cost_aware/kept_row_fraction"])
            out["inflation"].append(row.get("cost_aware/budget_inflation", float("nan")))
            out["informative"].append(row.get("cost_aware/informative_fraction", float("nan")))
    return out


# ==================================================================================================== analysis
def load_all(root: str, baseline_root: str, steps: int) -> dict[str, dict[int, dict]]:
    runs = te.load_runs(baseline_root, steps)
    for arm, by_seed in te.load_runs(root, steps).items():
        runs.setdefault(arm, {}).update(by_seed)
    return runs


def analyse(runs: dict[str, dict[int, dict]], auto_arms: list[str]) -> dict:
    grpo = runs.get("grpo", {})
    if not grpo:
        return {"error": "no GRPO runs"}
    start = float(np.mean([r["heldout_acc_start"] for r in grpo.values()]))
    end = float(np.mean([te.end_acc(r) for r in grpo.values()]))
    target = start + te.TARGET_FRACTION * (end - start)
    res = {"target": target, "grpo_start": start, "grpo_end": end, "arms": {}}

    def tokens_to_target(run):
        hit = te.reach(run, target)
        return None if hit is None else hit["policy_tokens"]

    fixed = [a for a in FIXED_ARMS if a in runs]
    # The best fixed fraction: the one with the lowest mean tokens-to-target ratio against GRPO (seeds with both).
    ratios_fixed = {}
    for a in fixed:
        r = [
            tokens_to_target(runs[a][s]) / tokens_to_target(grpo[s])
            for s in runs[a]
            if s in grpo and tokens_to_target(runs[a][s]) and tokens_to_target(grpo[s])
        ]
        ratios_fixed[a] = float(np.mean(r)) if r else float("inf")
    best_fixed = min(ratios_fixed, key=ratios_fixed.get) if ratios_fixed else None
    res["best_fixed"] = best_fixed
    for arm in ["grpo", *fixed, *auto_arms]:
        if arm not in runs:
            continue
        by_seed = runs[arm]
        seeds = sorted(by_seed)
        ttt = {s: tokens_to_target(by_seed[s]) for s in seeds}
        row = {
            "seeds": seeds,
            "reached": sum(v is not None for v in ttt.values()),
            "tokens_to_target": te.bootstrap_ci([v for v in ttt.values() if v is not None]),
            "steps_to_target": te.bootstrap_ci(
                [hit["step"] for s in seeds if (hit := te.reach(by_seed[s], target)) is not None]
            ),
            "final_acc": te.bootstrap_ci([te.end_acc(by_seed[s]) for s in seeds]),
            "policy_tokens_total": te.bootstrap_ci([by_seed[s]["totals"]["policy_tokens"] for s in seeds]),
        }
        for ref_name in dict.fromkeys(("grpo", best_fixed, *fixed)):
            if ref_name is None or ref_name == arm or ref_name not in runs:
                continue
            ref = runs[ref_name]
            paired = [s for s in seeds if s in ref]
            ratio = [ttt[s] / tokens_to_target(ref[s]) for s in paired if ttt[s] and tokens_to_target(ref[s])]
            row[f"tokens_ratio_vs_{ref_name}"] = te.bootstrap_ci(ratio)
            row[f"final_acc_diff_vs_{ref_name}"] = te.bootstrap_ci(
                [te.end_acc(by_seed[s]) - te.end_acc(ref[s]) for s in paired]
            )
            row[f"paired_seeds_vs_{ref_name}"] = len(paired)
        res["arms"][arm] = row
    return res


def _ci(t, fmt="{:.3f}") -> str:
    if t is None or t[0] is None:
        return "n/a"
    if t[1] is None:
        return fmt.format(t[0])
    return f"{fmt.format(t[0])} [{fmt.format(t[1])}, {fmt.format(t[2])}]"


def markdown(res: dict, command: str, kept: dict[str, dict]) -> str:
    if "error" in res:
        return res["error"]
    best = res["best_fixed"]
    lines = [
        f"`{command}`",
        "",
        f"Target: held-out accuracy {res['target']:.3f} (GRPO start {res['grpo_start']:.3f} + 80% of its mean "
        f"improvement to {res['grpo_end']:.3f}). Best fixed fraction (lowest mean tokens-to-target ratio vs GRPO): "
        f"{best}. Means with 95% bootstrap intervals over seeds; ratios and differences are paired per seed. "
        "Largest predicted inflation logged by an auto arm over all its steps: "
        + ", ".join(f"{a} {v['max_inflation']:.3f}" for a, v in kept.items() if v.get("max_inflation") is not None)
        + ".",
        "",
        "| arm | seeds (reached) | mean kept m/N | steps to target | policy tokens to target | ratio vs GRPO | "
        "ratio vs best fixed | final acc | final acc − GRPO | final acc − best fixed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, row in res["arms"].items():
        kf = kept.get(arm, {}).get("mean_kept_fraction")
        lines.append(
            f"| {arm} | {len(row['seeds'])} ({row['reached']}) | {'' if kf is None else f'{kf:.2f}'} | "
            f"{_ci(row['steps_to_target'], '{:.1f}')} | "
            f"{_ci(row['tokens_to_target'], '{:,.0f}')} | {_ci(row.get('tokens_ratio_vs_grpo'))} | "
            f"{_ci(row.get(f'tokens_ratio_vs_{best}'))} | {_ci(row['final_acc'])} | "
            f"{_ci(row.get('final_acc_diff_vs_grpo'), '{:+.3f}')} | "
            f"{_ci(row.get(f'final_acc_diff_vs_{best}'), '{:+.3f}')} |"
        )
    auto = [a for a in res["arms"] if a.startswith("auto_") or a.endswith("_la")]
    fixed = [a for a in res["arms"] if a in FIXED_ARMS]
    if auto and fixed:
        lines += [
            "",
            "Each auto / loss-aware arm against each fixed fraction, paired per seed (seeds both have): policy tokens "
            "to target (ratio) and final accuracy (difference).",
            "",
            "| arm | " + " | ".join(f"vs {f}: tokens ratio, final acc diff" for f in fixed) + " |",
            "|---|" + "---|" * len(fixed),
        ]
        for arm in auto:
            row = res["arms"][arm]
            cells = [
                f"{_ci(row.get(f'tokens_ratio_vs_{f}'))}, {_ci(row.get(f'final_acc_diff_vs_{f}'), '{:+.3f}')}"
                for f in fixed
            ]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kept_fraction_summary(root: str, baseline_root: str, runs: dict, arms: list[str]) -> dict[str, dict]:
    out = {}
    for arm in arms:
        series = []
        for seed in sorted(runs.get(arm, {})):
            for base in (root, baseline_root):
                d = os.path.join(base, f"{arm}__s{seed}")
                if os.path.exists(os.path.join(d, METRICS_FILE)):
                    series.append(step_series(d))
                    break
        if series:
            inflations = [x for s in series for x in s["inflation"] if np.isfinite(x)]
            out[arm] = {
                "max_inflation": max(inflations) if inflations else None,
                "mean_kept_fraction": float(
                    np.mean([np.mean(s["kept_fraction"]) for s in series if s["kept_fraction"]])
                ),
                "series": series,
            }
    return out


def plot_kept(kept: dict[str, dict], path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for k, (arm, info) in enumerate(kept.items()):
        color = f"C{k}"
        for i, s in enumerate(info["series"]):
            lab = arm if i == 0 else None
            ax1.plot(s["step"], s["kept_fraction"], color=color, alpha=0.35, lw=0.9, label=lab)
            share = np.array(s["kept_fraction"]) / np.maximum(np.array(s["informative"]), 1e-9)
            ax2.plot(s["step"], share, color=color, alpha=0.35, lw=0.9, label=lab)
        steps = sorted({x for s in info["series"] for x in s["step"]})
        mean = [
            np.mean([s["kept_fraction"][s["step"].index(x)] for s in info["series"] if x in s["step"]]) for x in steps
        ]
        ax1.plot(steps, mean, color=color, lw=2.2)
        info_mean = [
            np.mean([s["informative"][s["step"].index(x)] for s in info["series"] if x in s["step"]]) for x in steps
        ]
        if k == 0:
            ax1.plot(steps, info_mean, color="k", ls=":", lw=1.5, label="informative fraction")
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("kept rows m / N")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("kept rows / informative rows")
    ax2.set_ylim(0, 1.05)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path)


def plot_frontier(res: dict, path: str, title: str) -> None:
    """Final accuracy against policy tokens to target (ratio to GRPO's, paired), per arm with 95% intervals: the
    fixed fractions joined by a line, the auto budgets by another."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.6), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    groups = {
        "fixed fraction": [a for a in FIXED_ARMS if a in res["arms"]],
        "auto (δ rule)": sorted(
            (a for a in res["arms"] if a.startswith("auto_d") and a.count("_") == 1),
            key=lambda a: -float(a[len("auto_d") :]),
        ),
    }
    for k, (label, arms) in enumerate(groups.items()):
        xs, ys = [], []
        for a in arms:
            row = res["arms"][a]
            x, y = row.get("tokens_ratio_vs_grpo"), row["final_acc"]
            if not x or x[0] is None:
                continue
            xs.append(x[0])
            ys.append(y[0])
            xerr = [[x[0] - x[1]], [x[2] - x[0]]] if x[1] is not None else None
            yerr = [[y[0] - y[1]], [y[2] - y[0]]] if y[1] is not None else None
            ax.errorbar(x[0], y[0], xerr=xerr, yerr=yerr, color=f"C{k}", fmt="o", ms=4, capsize=2)
            ax.annotate(
                a.replace("cost_aware_", "").replace("auto_", ""),
                (x[0], y[0]),
                fontsize=7,
                xytext=(4, -10),
                textcoords="offset points",
            )
        order = np.argsort(xs)
        ax.plot(np.array(xs)[order], np.array(ys)[order], color=f"C{k}", lw=1.2, label=label)
    others = [a for a in res["arms"] if a not in sum(groups.values(), []) and a != "grpo"]
    for a in others:
        row = res["arms"][a]
        x, y = row.get("tokens_ratio_vs_grpo"), row["final_acc"]
        if x and x[0] is not None:
            ax.plot(x[0], y[0], "s", color="grey", ms=4)
            ax.annotate(a, (x[0], y[0]), fontsize=7, xytext=(4, 4), textcoords="offset points", color="grey")
    grpo = res["arms"]["grpo"]["final_acc"]
    ax.axhline(grpo[0], color="k", ls=":", lw=1, label=f"GRPO final accuracy {grpo[0]:.3f}")
    ax.set_xlabel("policy tokens to target / GRPO's (paired mean, 95% CI)")
    ax.set_ylabel("final held-out accuracy (mean of last 3 evals)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.savefig(path)


def write_results(root: str, baseline_root: str, steps: int, tag: str, command: str, auto_arms: list[str]) -> dict:
    runs = load_all(root, baseline_root, steps)
    auto_arms = list(dict.fromkeys([*auto_arms, *extra_arms(runs)]))
    res = analyse(runs, auto_arms)
    kept = kept_fraction_summary(root, baseline_root, runs, [*FIXED_ARMS, *auto_arms])
    base = os.path.join(common.RESULTS, f"adaptive_budget_{tag}")
    res.update(command=command, steps=steps, kept={a: v["mean_kept_fraction"] for a, v in kept.items()})
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    md = markdown(res, command, kept)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    if "error" not in res:
        auto_kept = {a: kept[a] for a in auto_arms if a in kept}
        if auto_kept:
            plot_kept(auto_kept, base + "_kept.png", f"Auto budget: kept fraction per step ({steps} steps)")
        curve_arms = ("grpo", *FIXED_ARMS, *auto_arms)
        plot_frontier(res, base + "_frontier.png", f"Tokens to target against final accuracy ({steps} steps)")
        te.plot_curves(
            runs,
            [a for a in curve_arms if a and a in runs],
            base + "_curves.png",
            f"Auto budget vs fixed fractions and GRPO ({steps} steps)",
            res["target"],
        )
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--deltas", type=float, nargs="*", default=list(DELTAS))
    p.add_argument("--no-recenter", action="store_true", help="skip the recentred-weights auto arm")
    p.add_argument("--proxy", default="advantage", choices=["advantage", "loss_aware"], help="proxy of the auto arms")
    p.add_argument("--fixed-loss-aware", type=float, nargs="*", default=[], help="fixed fractions with loss_aware")
    p.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default {common.DEFAULT_STEPS})")
    p.add_argument("--out", default=None, help="run folder (default outputs/bench/adaptive_budget_<tag>)")
    p.add_argument("--baseline-root", default=None, help="token-efficiency run folder with the GRPO and fixed arms")
    p.add_argument("--run-missing-baselines", action="store_true", help="run GRPO/fixed arms absent from it here")
    p.add_argument("--tag", default="full")
    p.add_argument("--analyze-only", action="store_true")
    args = p.parse_args(argv)
    steps = args.steps or common.DEFAULT_STEPS
    root = args.out or os.path.join(common.ROOT, "outputs", "bench", f"adaptive_budget_{args.tag}")
    baseline_root = args.baseline_root or os.path.join(common.ROOT, "outputs", "bench", "token_efficiency_full")
    command = " ".join(["python benchmarks/adaptive_budget.py", *(argv if argv is not None else sys.argv[1:])])
    auto = [(d, "none") for d in args.deltas] + ([] if args.no_recenter else [(RECENTER_DELTA, "recenter")])
    auto_arms = [auto_arm_name(d, n, args.proxy) for d, n in auto]
    os.makedirs(common.RESULTS, exist_ok=True)
    if not args.analyze_only:
        t0 = time.perf_counter()
        for seed in range(args.seeds):
            if args.run_missing_baselines:
                have = te.load_runs(baseline_root, steps)
                for arm in ("grpo", *FIXED_ARMS):
                    if seed not in have.get(arm, {}):
                        common.run_arm(arm, seed, root, steps=steps)
            jobs = [(auto_arm_name(d, n, args.proxy), d, n) for d, n in auto]
            jobs += [(f"cost_aware_{f:g}_la", f, None) for f in args.fixed_loss_aware]
            for name, value, norm in jobs:
                if norm is None:  # a fixed fraction with the loss-aware proxy
                    settings = {"cost_aware_kept_fraction": value, "cost_aware_proxy": "loss_aware"}
                    r = common.run_arm(
                        {"trainer": "cost_aware", "settings": settings}, seed, root, name=name, steps=steps
                    )
                else:
                    r = run_auto(value, seed, root, steps, norm, args.proxy)
                print(
                    f"{name} seed {seed}: held-out {r['heldout_acc_start']:.3f} -> "
                    f"{r['heldout_acc_end']:.3f}, policy tokens {r['totals']['policy_tokens']:,.0f}, "
                    f"train {r['train_wall_s']:.0f}s (elapsed {time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
            write_results(root, baseline_root, steps, args.tag, command, auto_arms)
    res = write_results(root, baseline_root, steps, args.tag, command, auto_arms)
    runs = load_all(root, baseline_root, steps)
    kept = kept_fraction_summary(root, baseline_root, runs, [*FIXED_ARMS, *auto_arms, *extra_arms(runs)])
    print(markdown(res, command, kept))


if __name__ == "__main__":
    main()
