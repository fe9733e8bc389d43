"""`make demo`: GRPO and Cost-Aware GRPO side by side on the embedded default (tiny model, arithmetic task).
`make demo-long`: the same on the long testbed (counting, completions of 2 to 96 tokens).

    python -m trl_costaware.demo [--steps 50] [--seed 0] [--output_dir outputs/demo] [--testbed long]

Builds (or reuses) the tiny model and its SFT warm-up, trains both arms from the same checkpoint with the same seed,
the same prompts and the same rollouts per step (the `trl_costaware.embedded.testbed` recipe: 64 prompts x 16
rollouts), and measures held-out accuracy (512 fixed problems, one sample at T = 1) every few steps. Prints, per arm,
held-out accuracy at the start and end, policy-optimisation tokens and the tokens to reach the target, and writes
``summary.json`` and ``heldout_accuracy.png`` to the output folder.

The target is the start accuracy plus 80% of GRPO's improvement in this run (its last `END_POINTS` evaluations
averaged, minus the start). When GRPO's improvement is not above the noise (`NOISE_SE` standard errors of a
difference of two held-out measurements) there is no target: no tokens-to-target is claimed for either arm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings

from trl_costaware.embedded.testbed import DEFAULT_STEPS, EVAL_EVERY, GRPO_RECIPE, HELDOUT_N

DEMO_SETTINGS = GRPO_RECIPE  # the recipe both arms use (kept under its old name for scripts that import it)
ARMS = {"grpo": {"cost_aware": False}, "cost_aware_grpo": {"cost_aware": True}}
TARGET_FRACTION = 0.8
END_POINTS = 3
NOISE_SE = 2.0


def demo_target(grpo_curve: list[dict], n: int) -> tuple[float | None, str]:
    """(target, why). Target = a0 + 0.8·(ā_end − a0), with a0 the start accuracy and ā_end the mean of the last
    `END_POINTS` evaluations, if ā_end − a0 > `NOISE_SE` · SE, where SE = √(2·p(1−p)/n) is the standard error of the
    difference of two accuracies measured on n problems (p = a0); otherwise (None, reason)."""
    start = grpo_curve[0]["heldout_acc"]
    tail = [p["heldout_acc"] for p in grpo_curve[1:]][-END_POINTS:]
    if not tail:
        return None, "GRPO has no evaluation after the start"
    end = sum(tail) / len(tail)
    se = math.sqrt(2 * max(start * (1 - start), 1e-4) / n)
    if end - start <= NOISE_SE * se:
        return None, f"GRPO improved {end - start:+.3f}, not above the noise ({NOISE_SE:g} SE = {NOISE_SE * se:.3f})"
    return start + TARGET_FRACTION * (end - start), f"start + {TARGET_FRACTION:.0%} of GRPO's improvement"


def tokens_to_target(curve: list[dict], target: float | None) -> float | None:
    """Policy tokens where the held-out curve first reaches `target`, linearly interpolated between the last
    evaluation below it and the first at or above it (None when never reached or no target)."""
    if target is None:
        return None
    for i, point in enumerate(curve):
        if point["heldout_acc"] >= target:
            if i == 0:
                return point["policy_tokens"]
            prev = curve[i - 1]
            f = (target - prev["heldout_acc"]) / (point["heldout_acc"] - prev["heldout_acc"])
            return prev["policy_tokens"] + f * (point["policy_tokens"] - prev["policy_tokens"])
    return None


def finish_accuracy_plot(fig, ax, target: float | None, path: str, title: str, legend_size=None) -> None:
    """Target line, axis labels, title and legend of a held-out accuracy vs policy tokens figure; saves and closes
    it (shared by the demo and benchmarks/token_efficiency.py)."""
    import matplotlib.pyplot as plt

    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel("policy-optimisation tokens (millions)")
    ax.set_ylabel("held-out accuracy (T=1, 512 problems)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(results: dict[str, dict], target: float | None, path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, res in results.items():
        xs = [p["policy_tokens"] / 1e6 for p in res["curve"]]
        ys = [p["heldout_acc"] for p in res["curve"]]
        ax.plot(xs, ys, marker="o", ms=3, label=name)
    finish_accuracy_plot(fig, ax, target, path, title)
    return path


def run_demo(
    steps: int | None = DEFAULT_STEPS,
    seed: int = 0,
    output_dir: str = "outputs/demo",
    eval_every: int = EVAL_EVERY,
    eval_n: int = HELDOUT_N,
    settings: dict | None = None,
    progress: bool = True,
    model_path: str | None = None,
    testbed: str = "default",
) -> dict:
    """Train both arms and write ``summary.json`` and the figure; returns the summary. `settings` are extra
    `CostAwareGRPOConfig` fields for both arms (tests use it to shrink the run)."""
    from trl_costaware.embedded.testbed import get_testbed, train_run

    steps = get_testbed(testbed).steps if steps is None else steps
    os.makedirs(output_dir, exist_ok=True)
    results = {}
    for name, arm_settings in ARMS.items():
        results[name] = train_run(
            seed=seed,
            output_dir=os.path.join(output_dir, name),
            steps=steps,
            settings={**(settings or {}), **arm_settings},
            eval_every=eval_every,
            eval_n=eval_n,
            model_path=model_path,
            progress=f"{name:>16}" if progress else None,
            run_group="demo" if testbed == "default" else f"demo-{testbed}",
            testbed=testbed,
        )
    target, why = demo_target(results["grpo"]["curve"], eval_n)
    summary = {
        "steps": steps,
        "seed": seed,
        "testbed": testbed,
        "heldout_problems": eval_n,
        "target": target,
        "target_rule": why,
        "arms": {
            name: {
                "heldout_accuracy_start": r["heldout_acc_start"],
                "heldout_accuracy_end": r["heldout_acc_end"],
                "greedy_accuracy_start": r["greedy_acc_start"],
                "greedy_accuracy_end": r["greedy_acc_end"],
                "policy_tokens": r["totals"]["policy_tokens"],
                "generated_tokens": r["totals"]["generated_tokens"],
                "tokens_to_target": tokens_to_target(r["curve"], target),
                "train_wall_s": r["train_wall_s"],
                "curve": r["curve"],
            }
            for name, r in results.items()
        },
    }
    summary["figure"] = plot_curves(
        results,
        target,
        os.path.join(output_dir, "heldout_accuracy.png"),
        f"Embedded {testbed} testbed, seed {seed}: held-out accuracy vs policy tokens",
    )
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    return summary


def _default_settings() -> str:
    """The defaults the Cost-Aware arm runs with, read from the config class (an unset kept fraction means
    `config.DEFAULT_KEPT_FRACTION`)."""
    import dataclasses

    from trl_costaware import CostAwareGRPOConfig
    from trl_costaware.config import DEFAULT_KEPT_FRACTION

    d = {f.name: f.default for f in dataclasses.fields(CostAwareGRPOConfig)}
    kept = d["cost_aware_kept_fraction"] or DEFAULT_KEPT_FRACTION
    return f"kept fraction {kept!r}, weights {d['cost_aware_weight_normalization']!r}"


def format_summary(summary: dict) -> str:
    lines = [
        f"Embedded {summary.get('testbed', 'default')} testbed, {summary['steps']} steps per arm, seed "
        f"{summary['seed']}, same prompts and rollouts; "
        f"held-out accuracy on {summary['heldout_problems']} problems (one sample at T=1; ±0.02).",
        "",
        "| arm | held-out acc start → end | greedy start → end | policy tokens | tokens to target | train s |",
        "|---|---|---|---|---|---|",
    ]
    for name, a in summary["arms"].items():
        reach = "not reached" if a["tokens_to_target"] is None else f"{a['tokens_to_target']:,.0f}"
        if summary["target"] is None:
            reach = "no target"
        lines.append(
            f"| {name} | {a['heldout_accuracy_start']:.3f} → {a['heldout_accuracy_end']:.3f} | "
            f"{a['greedy_accuracy_start']:.3f} → {a['greedy_accuracy_end']:.3f} | {a['policy_tokens']:,.0f} | "
            f"{reach} | {a['train_wall_s']:.0f} |"
        )
    lines.append("")
    if summary["target"] is None:
        lines.append(f"No tokens-to-target claim: {summary['target_rule']}.")
    else:
        lines.append(f"Target held-out accuracy {summary['target']:.3f} ({summary['target_rule']}).")
        base, ca = summary["arms"]["grpo"], summary["arms"]["cost_aware_grpo"]
        if base["tokens_to_target"] and ca["tokens_to_target"]:
            ratio = ca["tokens_to_target"] / base["tokens_to_target"]
            lines.append(
                f"Cost-Aware GRPO reached it with {ratio:.2f}x GRPO's policy tokens in this one run; one seed is an "
                "illustration, the 10-seed result with intervals is in BENCHMARKS.md."
            )
    saved = 1 - summary["arms"]["cost_aware_grpo"]["policy_tokens"] / summary["arms"]["grpo"]["policy_tokens"]
    lines.append(
        f"Over the same rollouts, Cost-Aware GRPO (the package defaults: {_default_settings()}) trained on "
        f"{saved:.0%} fewer policy tokens."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default: the testbed's)")
    parser.add_argument("--testbed", default="default", choices=("default", "long"), help="embedded testbed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval_every", type=int, default=EVAL_EVERY, help="held-out evaluation every N steps")
    parser.add_argument("--output_dir", default="outputs/demo")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed (imported by TRL) warns when it has to guess
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices, once per eval
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars; the demo's own bars stay

    from trl_costaware.embedded.testbed import get_testbed

    bed = get_testbed(args.testbed)
    print(
        f"Building the tiny model and its SFT warm-up for the {bed.name} testbed (cached after the first run; 2-8 min)"
        " ...",
        flush=True,
    )
    print(f"  model: {bed.model_path()}", flush=True)
    output_dir = (
        args.output_dir if args.testbed == "default" or args.output_dir != "outputs/demo" else "outputs/demo-long"
    )
    summary = run_demo(args.steps, args.seed, output_dir, args.eval_every, testbed=args.testbed)
    print()
    print(format_summary(summary))
    print(f"\nFigure: {summary['figure']}  Summary: {os.path.join(output_dir, 'summary.json')}")
    print(f"Metric records: {output_dir}/<arm>/ (`trl-costaware compare {output_dir}/*`).")


if __name__ == "__main__":
    main()
