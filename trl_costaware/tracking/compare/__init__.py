"""`trl-costaware compare`: reward against tokens for a baseline and a cost-aware arm, and the tokens saved.

One role per module:

- `readers`: runs from their local record (``cost_aware_metrics.jsonl`` + ``cost_aware_run.json``, written by every
  run) or from W&B online (``entity/project/run_id``, ``entity/project/groups/NAME``, through ``wandb.Api()``);
- `curves`: smoothing, first crossings, seeds averaged on a common grid;
- `noise`: whether the baseline improved beyond noise — the rule that gates every claim;
- `compute`: what a run costs to a target from tokens and a phase split (baseline-step units), the break-even steps
  ratio;
- `targets`: arms, the baseline's targets (its peak and 99% of it), tokens and wall time to reach them, savings;
- `report` (markdown) and `plot` (PNG); `cli`: the command.

Runs are grouped into arms (``--label``, ``--arm-by``, else the run's arm: ``baseline`` for ``cost_aware=False``,
else ``cost_aware``), seeds of an arm are averaged on a common token grid, and for every run and arm the table gives
the final and peak value of the (smoothed) metric and the tokens needed to first reach the baseline arm's peak and
99% of it — the paper's metric — with the saving against the baseline, and the wall time to the same targets. Those
numbers are given only when the baseline improved beyond noise (`noise`); otherwise the report says "baseline did
not improve beyond noise: no claim".
"""

from .cli import build_parser, main
from .compute import (
    GPU_GEN77,
    GPU_VERL,
    SPLITS,
    Split,
    TokenWeights,
    break_even_steps_ratio,
    cpu_split,
    measured_update_share,
    parse_split,
    phase_step_cost,
    step_cost,
    token_weights,
)
from .curves import Curve, aggregate, first_crossing, raw_series, run_curve, smooth, smoothing_window
from .noise import NO_CLAIM, NoiseCheck, baseline_improvement
from .plot import X_LABELS, plot
from .readers import (
    CompareError,
    RunHistory,
    canonical_key,
    canonical_x,
    discover,
    duplicated_steps,
    load_runs,
    looks_like_wandb_path,
    read_local_run,
    read_wandb_online,
)
from .report import NOT_REACHED, fmt_num, fmt_pct, fmt_seconds, fmt_tokens, fmt_x, format_report
from .targets import (
    DEFAULT_FRACTIONS,
    DEFAULT_METRIC,
    DEFAULT_SMOOTH,
    DEFAULT_SPLIT,
    DEFAULT_X,
    Result,
    Target,
    add_compute,
    assign_labels,
    compare_runs,
)

__all__ = [
    "DEFAULT_FRACTIONS",
    "DEFAULT_METRIC",
    "DEFAULT_SMOOTH",
    "DEFAULT_SPLIT",
    "DEFAULT_X",
    "GPU_GEN77",
    "GPU_VERL",
    "SPLITS",
    "Split",
    "TokenWeights",
    "add_compute",
    "break_even_steps_ratio",
    "cpu_split",
    "measured_update_share",
    "parse_split",
    "phase_step_cost",
    "step_cost",
    "token_weights",
    "NOT_REACHED",
    "NO_CLAIM",
    "X_LABELS",
    "CompareError",
    "Curve",
    "NoiseCheck",
    "Result",
    "RunHistory",
    "Target",
    "aggregate",
    "assign_labels",
    "baseline_improvement",
    "build_parser",
    "canonical_key",
    "canonical_x",
    "compare_runs",
    "discover",
    "duplicated_steps",
    "first_crossing",
    "fmt_num",
    "fmt_pct",
    "fmt_seconds",
    "fmt_tokens",
    "fmt_x",
    "format_report",
    "load_runs",
    "looks_like_wandb_path",
    "main",
    "plot",
    "raw_series",
    "read_local_run",
    "read_wandb_online",
    "run_curve",
    "smooth",
    "smoothing_window",
]
