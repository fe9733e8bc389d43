"""`trl-costaware compare` sets each arm's own response model (what `cost_aware_prompt_fraction` logged) beside its
measured compute to the target (issue 39 item 3): synthetic histories with known numbers, and a real short run with
the rule on."""

from __future__ import annotations

import math

import pytest

from trl_costaware.tracking.compare import (
    NO_CLAIM,
    RunHistory,
    arm_predictions,
    compare_runs,
    format_report,
    read_local_run,
    run_predictions,
)


def history(name, steps, ys, arm, gen_per_step, policy_per_step, extra=None, seed=0):
    """One row per step with cumulative tokens at constant rates; `extra(step)` adds logged keys to a row."""
    rows = []
    for s, y in zip(steps, ys, strict=True):
        row = {
            "step": s,
            "reward": float(y),
            "wall_time": float(s),
            "cost_aware/generated_tokens": float(gen_per_step * s),
            "cost_aware/policy_tokens": float(policy_per_step * s),
        }
        row.update((extra or (lambda _s: {}))(s))
        rows.append(row)
    info = {"arm": arm, "cost_aware": arm != "baseline", "seed": seed}
    return RunHistory(name=name, source=name, kind="local", rows=rows, info=info)


def auto_rows(step):
    """What the "auto" rule logs: a fallback on the first two batches, then a fraction 0.5 with its predictions."""
    if step <= 2:
        return {"cost_aware/prompt_fraction": 1.0, "cost_aware/prompt_rule_fallback": 1.0}
    return {
        "cost_aware/prompt_fraction": 0.5,
        "cost_aware/prompt_rule_fallback": 0.0,
        "cost_aware/predicted_step_ratio": 1.2,
        "cost_aware/predicted_compute_ratio": 0.6,
        "cost_aware/predicted_compute_half": 0.6,
        "cost_aware/predicted_compute_quarter": 0.45 + 0.01 * step,
        "cost_aware/predicted_steps_half": 1.2,
        "cost_aware/predicted_steps_quarter": float("nan"),  # a non-finite value is skipped, not averaged
    }


def section_row(report: str, arm: str) -> list[str]:
    """The cells of `arm`'s row in the report's response-model section."""
    lines = report.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("The arms' own response model"))
    line = next(ln for ln in lines[start:] if ln.startswith(f"| {arm} "))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_run_and_arm_predictions_are_means_of_what_was_logged():
    steps = list(range(1, 7))
    a = history("a", steps, [0.0] * 6, "cost_aware", 1000, 1000, auto_rows)
    b = history("b", steps[:4], [0.0] * 4, "cost_aware", 1000, 1000, auto_rows, seed=1)
    pa = run_predictions(a)
    assert pa["prompt_fraction"] == pytest.approx((2 * 1.0 + 4 * 0.5) / 6)
    assert pa["prompt_rule_fallback"] == pytest.approx(2 / 6)
    assert pa["predicted_compute_quarter"] == pytest.approx(0.45 + 0.01 * 4.5)
    assert "predicted_steps_quarter" not in pa  # only NaN was logged
    arm = arm_predictions([a, b])
    pb = run_predictions(b)
    # runs' means averaged (the short run weighs as much as the long one)
    assert arm["predicted_compute_quarter"]["mean"] == pytest.approx(
        (pa["predicted_compute_quarter"] + pb["predicted_compute_quarter"]) / 2
    )
    assert arm["prompt_fraction"]["runs"] == 2
    assert arm_predictions([history("g", steps, [0.0] * 6, "baseline", 1000, 1000)]) == {}


def test_report_puts_the_prediction_beside_the_measured_compute():
    """Baseline: 1000 generated + 1000 policy tokens a step, reaches 1.0 at step 4. The auto arm generates half the
    prompts (500 + 500 a step: its step costs 0.5 of the baseline's under any split) and reaches 1.0 at step 6: its
    measured compute to the target is 3 baseline steps, 0.75 of the baseline's 4, beside its predicted 0.6."""
    steps = [1, 2, 3, 4, 5, 6, 7]
    runs = [
        history("base", steps, [0.0, 0.25, 0.5, 1.0, 0.9, 0.9, 0.9], "baseline", 1000, 1000),
        history("auto", steps, [0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0], "cost_aware", 500, 500, auto_rows),
    ]
    result = compare_runs(runs, smoothing=0, fractions=(1.0,))
    auto = next(a for a in result.arms if a["arm"] == "cost_aware")
    assert auto["targets"][0]["compute"] == pytest.approx(3.0)
    assert auto["predictions"]["predicted_compute_ratio"]["mean"] == pytest.approx(0.6)
    base = next(a for a in result.arms if a["arm"] == "baseline")
    assert base["predictions"] == {}
    report = format_report(result)
    # prompt fraction: (2 × 1.0 + 5 × 0.5) / 7 batches; predicted steps 1.2, compute 0.6; measured 3 / 4
    assert section_row(report, "cost_aware")[:5] == ["cost_aware", "0.643", "1.2", "0.6", "0.75"]
    assert result.to_json()["arms"][1]["predictions"]["prompt_fraction"]["runs"] == 1
    # no arm logged a prediction: no section
    plain = compare_runs(runs[:1] + [history("ca", steps, [0.0] * 7, "cost_aware", 1000, 500)], smoothing=0)
    assert "own response model" not in format_report(plain)


def test_prediction_section_says_no_claim_when_the_baseline_is_noise():
    steps = list(range(1, 9))
    flat = [0.5, 0.52, 0.49, 0.51, 0.5, 0.48, 0.52, 0.5]
    runs = [
        history("base", steps, flat, "baseline", 1000, 1000),
        history("auto", steps, flat, "cost_aware", 500, 500, auto_rows),
    ]
    result = compare_runs(runs, smoothing=0, fractions=(1.0,))
    assert not result.claim
    assert section_row(format_report(result), "cost_aware")[4] == NO_CLAIM


def test_real_run_with_the_rule_on_logs_what_compare_reads(tmp_path):
    """A short real run with cost_aware_prompt_fraction="auto" under the token cost model (no probes): its local
    record holds the fraction and fallback flag per generation batch, which compare reads back."""
    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded.arithmetic import arithmetic_dataset, arithmetic_reward
    from trl_costaware.embedded.model import tiny_model_path
    from trl_costaware.tracking.callbacks import MetricsRecorderCallback, attach_tracking

    args = CostAwareGRPOConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        cost_aware=False,
        cost_aware_prompt_fraction="auto",
        cost_aware_cost_model="tokens",
        disable_tqdm=True,
    )
    trainer = CostAwareGRPOTrainer(
        tiny_model_path(), [arithmetic_reward], args=args, train_dataset=arithmetic_dataset(32, seed=0)
    )
    if not any(isinstance(cb, MetricsRecorderCallback) for cb in trainer.callback_handler.callbacks):
        attach_tracking(trainer)
    trainer.train()
    run = read_local_run(str(tmp_path / "run"))
    p = run_predictions(run)
    assert p["prompt_fraction"] == pytest.approx(1.0)  # fewer than 4 noise pairs: every prompt (the fallback)
    assert p["prompt_rule_fallback"] == pytest.approx(1.0)
    assert math.isfinite(p["predicted_step_ratio"])
