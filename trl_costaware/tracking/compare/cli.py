"""``trl-costaware compare``: the command line."""

from __future__ import annotations

import argparse
import json
import sys

from .._extras import require
from .compute import PUBLISHED_ALPHA, SPLITS, parse_split
from .plot import PLOT_ALTERNATIVE, PLOT_FEATURE, plot
from .readers import CompareError, load_runs
from .report import format_report
from .targets import DEFAULT_FRACTIONS, DEFAULT_METRIC, DEFAULT_SMOOTH, compare_runs


def build_parser(prog: str = "trl-costaware compare") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Compare runs by a metric against tokens: tokens the cost-aware arm needs to reach the "
        "baseline's peak (and 99% of it), saving in %, wall time; writes a PNG of metric against tokens. No "
        "tokens-to-target number or saving is given unless the baseline improved beyond noise (a bootstrap interval "
        "over its seeds, or 2 standard errors for one run; see docs/tracking.md).",
    )
    p.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run output dir (with cost_aware_metrics.jsonl), a folder of them, or a W&B run entity/project/run_id "
        "or group entity/project/groups/NAME (online, through wandb.Api)",
    )
    p.add_argument("--metric", default=DEFAULT_METRIC, help="metric: reward (default), eval_reward, eval/reward, ...")
    p.add_argument(
        "--x",
        default="policy_tokens",
        help="x-axis: policy_tokens (default), policy_tokens_padded, generated_tokens, rollout_tokens, num_tokens, "
        "wall_time, step, or any logged cumulative key",
    )
    p.add_argument(
        "--smooth",
        type=float,
        default=DEFAULT_SMOOTH,
        help="0: none; in (0, 1): debiased EMA weight (like W&B's slider); >= 1: rolling mean over that many "
        f"points (default {DEFAULT_SMOOTH})",
    )
    p.add_argument(
        "--min-points",
        type=int,
        default=None,
        help="drop each run's first N-1 smoothed points, where the average rests on a few noisy values "
        "(default: the smoothing window, about 1/(1-w) for an EMA; 1 keeps every point)",
    )
    p.add_argument(
        "--fractions",
        default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
        help="targets as fractions of the baseline peak (default 1,0.99)",
    )
    p.add_argument("--baseline", help="label of the baseline arm (default: the arm with cost_aware=False)")
    p.add_argument(
        "--label",
        action="append",
        metavar="PATTERN=LABEL",
        help="arm label for runs whose name, path or group matches the glob (repeatable; first match wins)",
    )
    p.add_argument(
        "--arm-by",
        action="append",
        metavar="FIELD",
        help="split arms by a run field or config field, e.g. --arm-by cost_aware_kept_fraction (repeatable)",
    )
    p.add_argument(
        "--compute-split",
        default="gpu",
        help="phase split of a baseline step for the compute columns: gpu (default; verl Qwen3-8B: generation 55%%, "
        "old/ref passes 19%%, update 26%%), gpu_gen77 (generation 77%%), cpu:U (a measured update share U, no "
        "passes), gen=A,passes=B,update=C, or none (no compute columns)",
    )
    p.add_argument(
        "--generation-alpha",
        type=float,
        default=1.0,
        metavar="A",
        help="generation time of a step ∝ (rows generated per step)^A, in [0, 1]: 1 (default) prices generation per "
        f"generated token; below 1 a batched accelerator generates more rows per second at larger batches "
        f"({PUBLISHED_ALPHA} fits PODS' published curve); matters only between arms that generate different rows per "
        "step",
    )
    p.add_argument("--band", choices=("minmax", "std", "none"), default="minmax", help="band around the seed mean")
    p.add_argument("--minimize", action="store_true", help="lower is better (e.g. a loss)")
    p.add_argument("--out", default="cost_aware_compare.png", help="PNG path (default ./cost_aware_compare.png)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--title", help="plot title")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while reading runs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.no_plot:  # before reading the runs, which can take minutes
            try:
                require("matplotlib", PLOT_FEATURE, PLOT_ALTERNATIVE)
            except ImportError as err:
                raise CompareError(str(err)) from err
        fractions = tuple(float(f) for f in args.fractions.split(",") if f.strip())
        if not fractions or any(not 0 < f <= 1 for f in fractions):
            raise CompareError(f"--fractions {args.fractions!r}: need numbers in (0, 1]")
        try:
            split = None if args.compute_split == "none" else parse_split(args.compute_split)
        except ValueError as err:
            raise CompareError(f"--compute-split: {err}; names: {', '.join(SPLITS)}") from err
        if not 0.0 <= args.generation_alpha <= 1.0:
            raise CompareError(f"--generation-alpha {args.generation_alpha}: a number in [0, 1]")
        runs = load_runs(args.runs, progress=False if args.no_progress else None)
        result = compare_runs(
            runs,
            metric=args.metric,
            x=args.x,
            smoothing=args.smooth,
            min_points=args.min_points,
            fractions=fractions,
            baseline=args.baseline,
            labels=args.label,
            arm_by=args.arm_by,
            band=args.band,
            minimize=args.minimize,
            compute_split=split,
            generation_alpha=args.generation_alpha,
        )
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_report(result))
    if not args.no_plot:
        plot(result, args.out, title=args.title)
        print(f"\nplot: {args.out}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result.to_json(), fh, indent=2)
        print(f"json: {args.json}")
    return 0
