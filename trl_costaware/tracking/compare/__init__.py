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

from .cli import main
from .plot import plot
from .readers import CompareError, RunHistory, load_runs
from .report import format_report
from .targets import Result, compare_runs

__all__ = ["CompareError", "Result", "RunHistory", "compare_runs", "format_report", "load_runs", "main", "plot"]
