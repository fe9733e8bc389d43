"""Evaluation between logging steps, then a checkpoint: every logged value is a plain Python number (TRL's
`TrainerState.save_to_json` serialises `log_history`), in both arms."""

from __future__ import annotations

import json
import numbers
import os

import pytest

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.embedded.model import tiny_model_path as build_tiny_model_path

pytestmark = pytest.mark.slow


def length_reward(completions, **kwargs):
    return [float(len(c) % 4) for c in completions]


@pytest.mark.parametrize("cost_aware", [True, False])
def test_eval_between_logging_steps_then_checkpoint(tmp_path, cost_aware):
    """eval_steps=2, logging_steps=5, save_steps=6 (the issue's reproduction): the evaluation-time `log` must not leave
    device tensors in the train metrics' window, and the checkpoint's trainer_state.json must be written."""
    args = CostAwareGRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        cost_aware=cost_aware,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=6,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=6,
        max_grad_norm=1e-8,  # every step clips: the device-side flag is appended at every step
        bf16=False,
        seed=0,
    )
    trainer = CostAwareGRPOTrainer(
        build_tiny_model_path(),
        [length_reward],
        args=args,
        train_dataset=arithmetic_dataset(32, seed=0),
        eval_dataset=arithmetic_dataset(4, seed=1),
    )
    trainer.train()
    rows = trainer.state.log_history
    assert any("eval_loss" in row for row in rows) and any("loss" in row for row in rows)
    for row in rows:
        for key, value in row.items():
            assert value is None or isinstance(value, (numbers.Number, str)), (key, type(value))
    clipped = [row["cost_aware/grad_clipped"] for row in rows if "cost_aware/grad_clipped" in row]
    assert clipped and all(type(v) is float for v in clipped)
    with open(os.path.join(args.output_dir, "checkpoint-6", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 6
