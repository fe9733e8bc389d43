"""What a run's own response model predicted, read back from its logged rows, to set beside what it measured.

A run with `cost_aware_prompt_fraction="auto"` (GRPO or cost-aware; docs/prompt_count.md) logs per generation batch the
fraction of the prompts it generated for, its predicted steps and compute to the target relative to the full batch
(``cost_aware/predicted_step_ratio``, ``cost_aware/predicted_compute_ratio``), and, once the rule predicts, what half
and a quarter of the prompts would cost (``cost_aware/predicted_compute_half`` / ``_quarter``,
``cost_aware/predicted_steps_half`` / ``_quarter``). A fixed fraction logs ``cost_aware/prompt_fraction`` only.

Per arm: each key's mean over the rows of every member run that logged it (the runs' means averaged, so that a long
run does not outweigh a short one), and the number of runs that logged it. Plain functions; `report` prints them.
"""

from __future__ import annotations

import math

import numpy as np

from .readers import RunHistory

PREFIX = "cost_aware/"
PREDICTION_KEYS = (
    "prompt_fraction",
    "prompt_rule_fallback",
    "predicted_step_ratio",
    "predicted_compute_ratio",
    "predicted_steps_half",
    "predicted_compute_half",
    "predicted_steps_quarter",
    "predicted_compute_quarter",
)


def run_predictions(run: RunHistory) -> dict[str, float]:
    """The run's mean of each `PREDICTION_KEYS` entry over the rows that logged it as a finite number."""
    out = {}
    for key in PREDICTION_KEYS:
        values = [
            float(r[PREFIX + key])
            for r in run.rows
            if isinstance(r.get(PREFIX + key), (int, float)) and math.isfinite(r[PREFIX + key])
        ]
        if values:
            out[key] = float(np.mean(values))
    return out


def arm_predictions(members: list[RunHistory]) -> dict[str, dict[str, float]]:
    """Per key: {"mean": the member runs' means averaged, "runs": how many logged it}; keys no member logged are
    absent (an empty dict: the arm logged no prediction)."""
    per_run = [run_predictions(r) for r in members]
    out = {}
    for key in PREDICTION_KEYS:
        values = [p[key] for p in per_run if key in p]
        if values:
            out[key] = {"mean": float(np.mean(values)), "runs": len(values)}
    return out
