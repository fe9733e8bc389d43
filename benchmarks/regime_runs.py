"""The regime matrix's cells and the readers of its runs, shared by the runner (`regime_matrix.py`) and the analyses
(`regime_analysis.py`, `prompt_analysis.py`, `noise_scale_check.py`): no run is started here, so the analyses import
it without importing the runner (the runner imports the analysis)."""

from __future__ import annotations

import json
import os

import numpy as np
from token_efficiency import END_POINTS, update_share  # noqa: F401  (END_POINTS re-exported)

from trl_costaware.tracking.compare.compute import GPU_GEN77, GPU_VERL, cpu_split, token_weights

SPLITS = {"cpu": None, "gpu": GPU_VERL, "gpu_gen77": GPU_GEN77}  # cpu: the cell's own measured GRPO split
CELLS = {
    f"{tb}{suffix}": (tb, kind)
    for tb in ("default", "long")
    for suffix, kind in (("", "as_is"), ("_late", "late"), ("_variance", "variance"), ("_epochs", "epochs"))
}
# Logged by the regime matrix's GRPO runs (`regime_matrix.with_zero_variance_share`; the trainer logged it itself
# until the prompt stage was removed, so older run records carry it under the same name).
ZERO_SHARE_KEY = "cost_aware/zero_variance_token_share"


def read_metrics(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "cost_aware_metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def informative_shares(output_dir: str) -> list[float]:
    """Per training step: the share of rows in groups with unequal rewards, 1 − TRL's ``frac_reward_zero_std`` (the
    rows that can carry a policy gradient at β = 0), from the run's metrics record."""
    return [1.0 - r["frac_reward_zero_std"] for r in read_metrics(output_dir) if "frac_reward_zero_std" in r]


def zero_variance_shares(output_dir: str) -> list[float]:
    """Per training step: the share of generated tokens in groups whose rewards are all equal (`ZERO_SHARE_KEY`),
    from the run's metrics record."""
    return [r[ZERO_SHARE_KEY] for r in read_metrics(output_dir) if ZERO_SHARE_KEY in r]


def load_cell_runs(cell_root: str) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for name in sorted(os.listdir(cell_root)) if os.path.isdir(cell_root) else []:
        path = os.path.join(cell_root, name, "run_result.json")
        if "__s" in name and os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                res = json.load(fh)
            runs.setdefault(res["arm"], {})[res["seed"]] = res
    return runs


def grpo_split_weights(grpo_runs: dict[int, dict], seed: int, steps: int) -> dict:
    """Per split, token weights calibrated to the same seed's GRPO run (its tokens per step = one unit); the CPU-like
    split is the cell's mean measured GRPO update share."""
    shares = [u for u in (update_share(r) for r in grpo_runs.values()) if u is not None]
    g = grpo_runs[seed]
    gen, pol = g["totals"]["generated_tokens"] / steps, g["totals"]["policy_tokens"] / steps
    splits = {k: (v or cpu_split(float(np.mean(shares)) if shares else 0.5)) for k, v in SPLITS.items()}
    return {k: token_weights(s, gen, pol) for k, s in splits.items()}
