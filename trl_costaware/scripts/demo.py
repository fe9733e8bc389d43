"""`make demo`: GRPO and Cost-Aware GRPO side by side on the embedded default (tiny model, arithmetic task).
`make demo-long`: the same on the long testbed (counting, completions of 2 to 96 tokens).

    python -m trl_costaware.scripts.demo [--steps 50] [--seed 0] [--output_dir outputs/demo] [--testbed long]

Builds (or reuses) the tiny model and its SFT warm-up, trains both arms from the same checkpoint with the same seed,
the same prompts and the same rollouts per step (the `trl_costaware.embedded.testbed` recipe: 64 prompts x 16
rollouts), and measures held-out accuracy (512 fixed problems, one sample at T = 1) every few steps. Prints, per arm,
held-out accuracy at the start and end, policy-optimisation tokens, and the policy tokens and the compute to reach
the target, and writes ``summary.json`` and ``heldout_accuracy.png`` (held-out accuracy against policy tokens and
against compute) to the output folder.

Compute is what a run costs in GRPO steps (`trl_costaware.tracking.compare.compute`): generated and policy tokens
weighted so that one step of this run's GRPO arm costs 1, at two phase splits of a GRPO step (`compute_splits`): verl's
GPU split (generation 55%, old/reference passes 19%, update 26%) and this machine's, measured on the GRPO arm (its
update share of a training step; no old/reference pass: β = 0, one iteration per generation batch). Policy tokens alone
leave out the generation, which every step pays in full, so they overstate what the cost-aware arm saves.

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

from trl_costaware.embedded.testbed import DEFAULT_STEPS, EVAL_EVERY, HELDOUT_N
from trl_costaware.tracking._extras import require
from trl_costaware.tracking.compare.compute import GPU_VERL, Split, cpu_split, measured_update_share, token_weights
from trl_costaware.tracking.compare.curves import first_crossing

PLOT_FEATURE = "the demo's figure"
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


def tokens_to_target(curve: list[dict], target: float | None, key: str = "policy_tokens") -> float | None:
    """`key` (policy tokens by default; any cumulative value of the curve's points, e.g. a compute) where the
    held-out curve first reaches `target`, linearly interpolated between the last evaluation below it and the first at
    or above it (None when never reached or no target; `curves.first_crossing`)."""
    if target is None:
        return None
    return first_crossing([p[key] for p in curve], [p["heldout_acc"] for p in curve], target)[0]


def compute_splits(grpo_run: dict) -> dict[str, Split]:
    """The phase splits of a GRPO step the demo prices compute at: ``gen55`` (verl's GPU split, `GPU_VERL`) and,
    when the GRPO run carries its phase timers, ``machine`` (this machine's, from the GRPO arm's measured update
    share: `cpu_split`)."""
    splits = {"gen55": GPU_VERL}
    share = measured_update_share(grpo_run.get("phase_s"))
    if share is not None:
        splits["machine"] = cpu_split(share, "machine")
    return splits


def add_compute(results: dict[str, dict], splits: dict[str, Split]) -> dict[str, dict]:
    """Give every curve point of every arm ``compute_<split>``: its generated and policy tokens priced in GRPO steps
    (`token_weights` calibrated to the GRPO arm's tokens per step, so its step costs 1). Returns the weights per
    split."""
    grpo = results["grpo"]
    steps = max(grpo["curve"][-1]["step"], 1)
    gen, pol = grpo["totals"]["generated_tokens"] / steps, grpo["totals"]["policy_tokens"] / steps
    weights = {name: token_weights(split, gen, pol) for name, split in splits.items()}
    for res in results.values():
        for point in res["curve"]:
            for name, w in weights.items():
                point[f"compute_{name}"] = w.compute(point["generated_tokens"], point["policy_tokens"])
    return weights


def split_label(name: str, split: Split) -> str:
    """How the table and the figure name a split."""
    if name == "machine":
        return f"this machine, gen {split.generation:.0%}"
    return f"gen {split.generation:.0%}"


def style_accuracy_axes(ax, target: float | None, xlabel: str, title: str, legend_size=None) -> None:
    """Target line, labels, title, grid and legend of one held-out accuracy panel."""
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.3f}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy (T=1, 512 problems)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def plot_curves(
    results: dict[str, dict], target: float | None, path: str, title: str, splits: dict[str, Split] | None = None
) -> str:
    """Held-out accuracy against policy tokens and, per split in `splits` (the curves carry ``compute_<split>``,
    `add_compute`), against compute in GRPO steps: one panel each, side by side."""
    require("matplotlib", PLOT_FEATURE).use("Agg")
    plt = require("matplotlib.pyplot", PLOT_FEATURE)

    splits = splits or {}
    fig, axes = plt.subplots(1, 1 + len(splits), figsize=(6.2 * (1 + len(splits)), 4.4), squeeze=False)
    axes = axes[0]
    for name, res in results.items():
        ys = [p["heldout_acc"] for p in res["curve"]]
        axes[0].plot([p["policy_tokens"] / 1e6 for p in res["curve"]], ys, marker="o", ms=3, label=name)
        for ax, key in zip(axes[1:], splits, strict=True):
            ax.plot([p[f"compute_{key}"] for p in res["curve"]], ys, marker="o", ms=3, label=name)
    style_accuracy_axes(axes[0], target, "policy-optimisation tokens (millions)", title + "\nagainst policy tokens")
    for ax, (key, split) in zip(axes[1:], splits.items(), strict=True):
        where = "measured on this machine's GRPO arm" if key == "machine" else split.source.split(":")[0]
        style_accuracy_axes(
            ax,
            target,
            "compute (GRPO steps: one GRPO step = 1)",
            f"against compute at {split.describe()}\n({where})",
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
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

    require("matplotlib", PLOT_FEATURE)  # before training, not after it
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
    splits = compute_splits(results["grpo"])
    weights = add_compute(results, splits)
    summary = {
        "steps": steps,
        "seed": seed,
        "testbed": testbed,
        "heldout_problems": eval_n,
        "target": target,
        "target_rule": why,
        "compute_units": "GRPO steps (one step of this run's GRPO arm = 1)",
        "compute_splits": {
            name: {
                **split.__dict__,
                "weight_per_generated_token": weights[name].gen,
                "weight_per_policy_token": weights[name].policy,
            }
            for name, split in splits.items()
        },
        "arms": {
            name: {
                "heldout_accuracy_start": r["heldout_acc_start"],
                "heldout_accuracy_end": r["heldout_acc_end"],
                "greedy_accuracy_start": r["greedy_acc_start"],
                "greedy_accuracy_end": r["greedy_acc_end"],
                "policy_tokens": r["totals"]["policy_tokens"],
                "generated_tokens": r["totals"]["generated_tokens"],
                "tokens_to_target": tokens_to_target(r["curve"], target),
                "compute": {k: r["curve"][-1][f"compute_{k}"] for k in splits},
                "compute_to_target": {k: tokens_to_target(r["curve"], target, f"compute_{k}") for k in splits},
                "train_wall_s": r["train_wall_s"],
                "phase_s": r.get("phase_s"),
                "curve": r["curve"],
            }
            for name, r in results.items()
        },
    }
    summary["figure"] = plot_curves(
        results,
        target,
        os.path.join(output_dir, "heldout_accuracy.png"),
        f"Embedded {testbed} testbed, seed {seed}: held-out accuracy",
        splits,
    )
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    return summary


def _default_settings() -> str:
    """The defaults the Cost-Aware arm runs with, read from the config class."""
    from trl_costaware import CostAwareGRPOConfig

    fld = CostAwareGRPOConfig.__dataclass_fields__
    kept, proxy, weights = (fld[f"cost_aware_{k}"].default for k in ("kept_fraction", "proxy", "weight_normalization"))
    return f"kept fraction {kept!r}, proxy {proxy!r}, weights {weights!r}"


def _reach(summary: dict, value, fmt) -> str:
    if summary["target"] is None:
        return "no target"
    return "not reached" if value is None else fmt(value)


def format_summary(summary: dict) -> str:
    splits = summary.get("compute_splits", {})
    compute_cols = [f"compute to target ({split_label(k, Split(**_split_fields(s)))})" for k, s in splits.items()]
    n, p = summary["heldout_problems"], summary["arms"]["grpo"]["heldout_accuracy_start"]
    lines = [
        f"Embedded {summary.get('testbed', 'default')} testbed, {summary['steps']} steps per arm, seed "
        f"{summary['seed']}, same prompts and rollouts; "
        f"held-out accuracy on {n} problems (one sample at T=1; SE ±{math.sqrt(max(p * (1 - p), 1e-4) / n):.2f}).",
        "",
        "| arm | held-out acc start → end | greedy start → end | policy tokens | policy tokens to target | "
        + "".join(f"{c} | " for c in compute_cols)
        + "train s |",
        "|---|---|---|---|---|" + "---|" * len(compute_cols) + "---|",
    ]
    for name, a in summary["arms"].items():
        cells = [
            name,
            f"{a['heldout_accuracy_start']:.3f} → {a['heldout_accuracy_end']:.3f}",
            f"{a['greedy_accuracy_start']:.3f} → {a['greedy_accuracy_end']:.3f}",
            f"{a['policy_tokens']:,.0f}",
            _reach(summary, a["tokens_to_target"], lambda v: f"{v:,.0f}"),
        ]
        cells += [_reach(summary, a["compute_to_target"][k], lambda v: f"{v:.1f} steps") for k in splits]
        cells.append(f"{a['train_wall_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    base, ca = summary["arms"]["grpo"], summary["arms"]["cost_aware_grpo"]
    if summary["target"] is None:
        lines.append(f"No tokens-to-target claim: {summary['target_rule']}.")
    else:
        lines.append(f"Target held-out accuracy {summary['target']:.3f} ({summary['target_rule']}).")
        if base["tokens_to_target"] and ca["tokens_to_target"]:
            ratio = ca["tokens_to_target"] / base["tokens_to_target"]
            parts = [f"{ratio:.2f}x GRPO's policy tokens"]
            for k, s in splits.items():
                b, c = base["compute_to_target"][k], ca["compute_to_target"][k]
                if b and c:
                    parts.append(f"{c / b:.2f}x its compute at {split_label(k, Split(**_split_fields(s)))}")
            lines.append(
                f"Cost-Aware GRPO reached it with {', '.join(parts)} in this one run; one seed is an illustration: "
                "compare seeds with `trl-costaware compare`."
            )
    saved = 1 - ca["policy_tokens"] / base["policy_tokens"]
    lines.append(
        f"Over the same rollouts, Cost-Aware GRPO (the package defaults: {_default_settings()}) trained on "
        f"{saved:.0%} fewer policy tokens."
    )
    if splits:
        described = "; ".join(
            f"{split_label(k, sp)}: {sp.describe()}"
            + (" (measured: GRPO's update share of a training step)" if k == "machine" else f" ({sp.source})")
            for k, sp in ((k, Split(**_split_fields(s))) for k, s in splits.items())
        )
        lines.append(
            "Compute = generated and policy tokens priced in GRPO steps (one GRPO step = 1; "
            f"trl_costaware.tracking.compare.compute) at each split — {described}. Every step pays the whole "
            "generation, so policy tokens alone overstate the saving."
        )
    return "\n".join(lines)


def _split_fields(d: dict) -> dict:
    return {k: d[k] for k in ("generation", "passes", "update", "name", "source")}


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
        f"Loading the {bed.name} testbed's warmed-up tiny model (its weights ship with the package: seconds; "
        "rebuilt from its recipe with TRL_COSTAWARE_REBUILD=1: minutes) ...",
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
