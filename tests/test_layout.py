"""The full micro-batch layout: arithmetic, config wiring, and a real run's micro-batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.rows.layout import Layout, full_micro_batch_layout


@given(
    rows=st.integers(1, 16),
    steps=st.integers(1, 8),
    inverse=st.sampled_from([1, 2, 4]),
    spg_factor=st.sampled_from([None, 1, 2]),
)
def test_layout_keeps_the_generation_batch_and_fills_micro_batches(rows, steps, inverse, spg_factor):
    f = 1 / inverse
    accumulation = steps * inverse
    spg = None if spg_factor is None else accumulation * spg_factor
    layout = full_micro_batch_layout(rows, accumulation, spg, f)
    spg_before, spg_after = spg or accumulation, layout.steps_per_generation or layout.gradient_accumulation_steps
    assert layout.per_device_train_batch_size * spg_after == rows * spg_before  # same generation batch
    assert layout.per_device_train_batch_size * f == rows  # each micro-batch holds B kept rows
    assert layout.gradient_accumulation_steps == accumulation * f


def test_layout_refuses_fractions_of_rows_or_steps():
    assert full_micro_batch_layout(8, 4, None, 0.5) == Layout(16, 2, None)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        full_micro_batch_layout(8, 3, None, 0.5)
    with pytest.raises(ValueError, match="whole numbers"):
        full_micro_batch_layout(8, 4, None, 0.3)


def _config(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        save_strategy="no",
        bf16=False,
        cost_aware_kept_fraction=0.5,
        cost_aware_layout="full",
    )
    kwargs.update(overrides)
    return CostAwareGRPOConfig(**kwargs)


def test_config_applies_the_layout_before_trl_derives_the_generation_batch(tmp_path):
    args = _config(tmp_path)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (8, 2, 2)
    assert args.generation_batch_size == 16  # what GRPO with 4 rows × 4 micro-steps generates
    plain = _config(tmp_path, cost_aware=False)  # the baseline arm of the same recipe is left as written
    assert (plain.per_device_train_batch_size, plain.gradient_accumulation_steps) == (4, 4)
    with pytest.raises(ValueError, match="cost_aware_token_budget"):
        _config(tmp_path, cost_aware_token_budget=100)
    with pytest.raises(ValueError, match="fixed cost_aware_kept_fraction"):
        _config(tmp_path, cost_aware_kept_fraction="auto")
    assert _config(tmp_path, cost_aware_kept_fraction="0.5").per_device_train_batch_size == 8  # parsed like the CLI
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        _config(tmp_path, gradient_accumulation_steps=3)


@pytest.mark.slow
def test_run_uses_fewer_full_micro_batches(tmp_path, tiny_model_path):
    """Same generation batch (16 rows), 8 kept rows: 2 policy micro-batches of 4 rows instead of 4 of 2."""

    def reward(completions, **kwargs):  # distinct values: every row informative, so the m cap does not bind
        return [float(i) for i in range(len(completions))]

    seen = {}
    arms = {"even": dict(cost_aware_layout="even"), "full": {}, "packed": dict(cost_aware_layout="packed")}
    for arm, options in arms.items():
        trainer = CostAwareGRPOTrainer(
            tiny_model_path,
            [reward],
            args=_config(tmp_path / arm, **options),
            train_dataset=arithmetic_dataset(32, seed=0),
        )
        rows = []

        def hook(module, args_, kwargs, rows=rows):
            if "labels" in kwargs and torch.is_grad_enabled():  # TRL's policy pass (generation has no labels)
                rows.append(kwargs["input_ids"].shape[0])

        handle = trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
        trainer.train()
        handle.remove()
        seen[arm] = (rows, trainer._cost_aware_totals["rows_generated"], trainer._cost_aware_totals["rows_kept"])
    assert seen["even"] == ([2, 2, 2, 2], 16, 8)
    assert seen["full"] == ([4, 4], 16, 8)
    assert seen["packed"] == ([4, 4], 16, 8)  # the same micro-batches; its 2 no-op micro-steps skip the model
