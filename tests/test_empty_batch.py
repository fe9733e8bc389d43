"""Batches with no loss tokens train on, as GRPOTrainer does: every completion cut under
`mask_truncated_completions=True` (a cap of 1 token), for every loss type, with and without a KL term.

The plan's factors when nothing kept carries a loss token are exact: KL scale 1 (β never becomes 0, on any rank:
TRL's `if self.beta != 0.0` branch holds collectives) and bnpo factor 1 (no correction). The two-process cases (a rank
with no loss tokens next to one with some) are in tests/test_distributed.py (`test_empty_batches_train_on`).
"""

from __future__ import annotations

import math

import pytest
import torch
from testing_utils import length_reward, make_config, tiny_dataset, weights_of
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.rows.plan import LOSS_NORMALISERS, PlanSettings, RowStats, plan_batch

LOSS_TYPES = sorted(LOSS_NORMALISERS)
BETAS = [0.0, 0.04]


def rows_without_loss_tokens(n=8) -> RowStats:
    """Rows with advantages (some zero) whose completions the truncation mask hides: no loss token anywhere."""
    return RowStats(
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 1.0, -1.0])[:n],
        costs=torch.full((n,), 4.0),
        loss_tokens=torch.zeros(n),
        proxy_factors=torch.ones(n),
        rollout_lengths=torch.full((n,), 5.0),
        generated_tokens=torch.ones(n),
        prompt_tokens=torch.full((n,), 4.0),
        completion_tokens=torch.zeros(n),
    )


# ---------------------------------------------------------------- the plan's factors
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("zero_advantage_carries_gradient", [False, True], ids=["beta0", "kl"])
def test_plan_factors_are_exact_when_nothing_kept_has_a_loss_token(loss_type, zero_advantage_carries_gradient):
    settings = PlanSettings(
        loss_type=loss_type,
        kept_fraction=0.5,
        steps_per_generation=2,
        zero_advantage_carries_gradient=zero_advantage_carries_gradient,
    )
    plan = plan_batch(rows_without_loss_tokens(), settings, torch.Generator().manual_seed(0))
    assert plan.filler.all() and torch.all(plan.factors == 0)
    normaliser = LOSS_NORMALISERS[loss_type]
    assert plan.kl_scale == (1.0 if normaliser.batch_tokens else None)  # was 0.0: β set to 0 on this rank only
    assert plan.micro_tokens_full is None  # bnpo: was 0.0, a ZeroDivisionError in the trainer


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if LOSS_NORMALISERS[t].batch_tokens])
def test_kl_scale_is_never_zero(loss_type):
    """A kept row with tokens: the scale is T_full / T_kept as before; none: 1 (never 0)."""
    rows = rows_without_loss_tokens()
    tokens = torch.tensor([3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0])
    rows = RowStats(**{**{k: rows[k] for k in RowStats.names()}, "loss_tokens": tokens, "completion_tokens": tokens})
    settings = PlanSettings(loss_type=loss_type, kept_fraction=0.25, steps_per_generation=1)
    plan = plan_batch(rows, settings, torch.Generator().manual_seed(0))
    kept = float(tokens[plan.indices].sum())
    assert kept > 0 and plan.kl_scale == pytest.approx(8.0 / kept)


# ---------------------------------------------------------------- real runs against GRPOTrainer
def _args(cls, tmp_path, loss_type, beta, suppress):
    return make_config(
        tmp_path,
        cls,
        max_completion_length=1,
        mask_truncated_completions=True,
        max_steps=1,
        learning_rate=1e-2,
        loss_type=loss_type,
        beta=beta,
        importance_sampling_level="sequence" if loss_type == "luspo" else "token",
        # Neither EOS nor padding can be the one token: every completion is truncated, and the mask hides it.
        generation_kwargs={"suppress_tokens": suppress},
    )


def eos_and_pad(model_path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return sorted({tokenizer.eos_token_id, tokenizer.pad_token_id})


@pytest.mark.slow
@pytest.mark.parametrize("beta", BETAS, ids=["beta0", "beta"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_no_loss_token_step_trains_on_as_grpo_trainer(tmp_path, tiny_model_path, loss_type, beta):
    """Every completion truncated: the step trains on, logs what GRPOTrainer logs (the KL metric included when
    β > 0), and moves the weights as GRPOTrainer does (not at all: every loss token is masked)."""
    runs = {}
    for name, trainer_cls, config_cls in (
        ("grpo", GRPOTrainer, GRPOConfig),
        ("cost_aware", CostAwareGRPOTrainer, CostAwareGRPOConfig),
    ):
        args = _args(config_cls, tmp_path / name, loss_type, beta, eos_and_pad(tiny_model_path))
        trainer = trainer_cls(tiny_model_path, [length_reward], args=args, train_dataset=tiny_dataset(16))
        before = weights_of(trainer.model)
        trainer.train()
        row = next(r for r in trainer.state.log_history if "loss" in r)
        runs[name] = (row, weights_of(trainer.model) - before)
    (grpo_row, grpo_move), (row, move) = runs["grpo"], runs["cost_aware"]
    assert grpo_row["completions/clipped_ratio"] == 1.0  # the case is the one meant: no loss token at all
    assert row["completions/clipped_ratio"] == 1.0
    assert math.isfinite(row["loss"]) and row["loss"] == grpo_row["loss"]
    trl_keys = {k for k in grpo_row if not k.startswith("cost_aware/")}
    assert trl_keys <= set(row), trl_keys - set(row)  # e.g. "kl" when β > 0
    if beta:
        assert row["kl"] == grpo_row["kl"] == 0.0
    torch.testing.assert_close(move, grpo_move)
