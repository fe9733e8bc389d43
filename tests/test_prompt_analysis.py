"""`benchmarks/prompt_analysis.py` on synthetic runs: targets along GRPO's run, paired ratios, the goals."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import prompt_analysis as pa  # noqa: E402

STEPS = 20
GEN, POL = 100.0, 200.0  # GRPO's generated and policy tokens per step


def _run(folder, arm, seed, *, speed, gen=GEN, pol=POL, steps=STEPS):
    """A curve rising from 0.5 by 0.04 × speed per step up to 0.9, with tokens per step `gen`, `pol`."""
    curve = [
        {
            "step": s,
            "generated_tokens": gen * s,
            "policy_tokens": pol * s,
            "heldout_acc": min(0.9, 0.5 + 0.04 * speed * s),
        }
        for s in range(0, steps + 1, 2)
    ]
    run = {
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "curve": curve,
        "heldout_acc_start": 0.5,
        "totals": {"generated_tokens": gen * steps, "policy_tokens": pol * steps},
        "phase_s": {"training_step": 10.0, "generate_and_score": 5.0},
        "zero_variance_shares": [0.1] * (steps - 5) + [0.6] * 5,
    }
    path = folder / f"{arm}__s{seed}"
    path.mkdir(parents=True)
    (path / "run_result.json").write_text(json.dumps(run))


def test_targets_ratios_and_goals(tmp_path):
    for s in range(3):
        _run(tmp_path, "grpo", s, speed=1.0)
        _run(tmp_path, "both", s, speed=2.0, pol=POL / 2, steps=STEPS)  # twice as fast per step, half the update
        _run(tmp_path, "greso", s, speed=1.0)
    res = pa.analyse(str(tmp_path))
    assert res["status"] == "run" and res["grpo_gain"][0] == pytest.approx(0.4)
    assert res["targets"] == pytest.approx({0.5: 0.7, 0.8: 0.82, 0.95: 0.88})
    both = res["arms"]["both"]
    # twice the accuracy per step: half the steps and generated tokens to the targets before GRPO's plateau (the
    # 95% target falls where the evaluation grid cuts GRPO's kink: 5.5 / 9.5 steps)
    for f, ratio in ((0.5, 0.5), (0.8, 0.5), (0.95, 5.5 / 9.5)):
        assert both[f"ratio_step_{f}"][0] == pytest.approx(ratio)
        assert both[f"ratio_generated_tokens_{f}"][0] == pytest.approx(ratio)
        # compute per step is below GRPO's (half the update), so compute to target is below the step ratio
        assert all(both[f"ratio_compute_{k}_{f}"][0] < ratio for k in ("cpu", "gpu", "gpu_gen77"))
    goals = res["goals"]
    assert goals["compute_gpu_0.8"]["met"] and goals["compute_gpu_gen77_0.95"]["met"]
    assert goals["vs_greso_gpu_0.5"]["met"]
    assert res["grpo_zero_variance_share_last_quarter"][0] == pytest.approx(0.6)
    md = pa.markdown({"cell": res}, "cmd")
    assert "| both | 80% | 3/3 |" in md and "NOT met" not in md


def test_a_slower_arm_fails_its_goals(tmp_path):
    for s in range(3):
        _run(tmp_path, "grpo", s, speed=1.0)
        _run(tmp_path, "both", s, speed=0.9)
        _run(tmp_path, "greso", s, speed=1.0)
    goals = pa.analyse(str(tmp_path))["goals"]
    assert not goals["compute_gpu_0.5"]["met"] and not goals["vs_greso_cpu_0.5"]["met"]
    assert not goals["compute_gpu_0.95"]["met"] and goals["compute_gpu_0.95"]["reached"] == "3/3"  # reached, dearer


def test_the_seed_major_schedule_completes_paired_seeds_first():
    """`regime_matrix.py --seed-major` (issue 38's rerun): GRPO for every seed first (an arm's step cap depends on
    every GRPO seed), then every arm of seed 0, then of seed 1: a partial run holds complete paired seeds."""
    import regime_matrix as rm

    order = rm.schedule(["c"], ["grpo", "a", "b"], [0, 1], seed_major=True)
    assert order == [("c", "grpo", 0), ("c", "grpo", 1), ("c", "a", 0), ("c", "b", 0), ("c", "a", 1), ("c", "b", 1)]
    assert rm.schedule(["c"], ["grpo", "a", "b"], [0, 1])[2:4] == [("c", "a", 0), ("c", "a", 1)]
