"""The "compute" rule in real runs of the trainer on the embedded tiny model (CPU, one process): what the noise scale
reads, what the plan decides from it, the measured costs, the config's refusals."""

from __future__ import annotations

import math

import pytest
import torch
from test_trainer import length_reward
from test_trainer import make_args as trainer_args

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware import trainer as trainer_module
from trl_costaware.compute_budget import cheapest_kept_count
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.embedded.model import tiny_model_path as build_tiny_model_path
from trl_costaware.sampling import capped_kept_count, gradient_proxy


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model_path()


def make_args(tmp_path, **overrides):
    """test_trainer's tiny run, 2 micro-steps per generation batch, 5 steps, the "compute" rule (token model)."""
    settings = dict(gradient_accumulation_steps=2, steps_per_generation=2, max_completion_length=12, max_steps=5)
    settings.update(cost_aware_kept_fraction="compute", cost_aware_cost_model="tokens")
    return trainer_args(tmp_path, **{**settings, **overrides})


class Recording(CostAwareGRPOTrainer):
    """Keeps a copy of the gradient the noise scale reads at each optimizer step."""

    def _init_compute_signals(self):
        super()._init_compute_signals()
        self.seen = []

    def _observe_gradient(self, model):
        if self._observed_step != self.state.global_step:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            self.seen.append(torch.cat([g.detach().flatten().clone() for g in grads]))
        super()._observe_gradient(model)


def train(model_path, args, cls=CostAwareGRPOTrainer):
    trainer = cls(model_path, reward_funcs=length_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0))
    trainer.train()
    return trainer


def step_rows(trainer):
    return [row for row in trainer.state.log_history if "cost_aware/kept_row_fraction" in row]


@pytest.mark.parametrize("max_grad_norm", [0.05, 0.0])
def test_noise_scale_reads_the_step_gradient_before_clipping(model_path, tmp_path, max_grad_norm):
    """|G_t|² is the square of the pre-clip norm the Trainer logs (clipped at 0.05: the clip changes the gradient
    after the read; 0: read in the pre-optimizer callback); G_t · G_t' pairs each step with the previous one (one
    optimizer step per generation batch here); the first step has no pair."""
    trainer = train(model_path, make_args(tmp_path, max_grad_norm=max_grad_norm), Recording)
    rows = step_rows(trainer)
    assert len(rows) == len(trainer.seen) == 5
    for row, grad in zip(rows, trainer.seen, strict=True):
        assert row["cost_aware/noise_grad_sq"] == pytest.approx(float(grad.pow(2).sum()), rel=1e-5)
        if max_grad_norm > 0:
            assert row["grad_norm"] ** 2 == pytest.approx(row["cost_aware/noise_grad_sq"], rel=1e-4)
    assert "cost_aware/noise_grad_dot" not in rows[0]
    for row, grad, previous in zip(rows[1:], trainer.seen[1:], trainer.seen[:-1], strict=True):
        assert row["cost_aware/noise_grad_dot"] == pytest.approx(float(grad @ previous), rel=1e-4, abs=1e-9)
    if max_grad_norm > 0:
        assert any(row["cost_aware/grad_clipped"] == 1.0 for row in rows)


def test_plan_keeps_the_cheapest_count_from_the_measured_signal(model_path, tmp_path, monkeypatch):
    """Every row that can carry gradient until the noise scale has an estimate; then the plan's own count is the
    rule's on the batch it saw (recomputed here from the plan's distribution and rows), capped as every rule is."""
    seen = []
    original = trainer_module.plan_batch

    def record(rows, settings, generator=None, collective=None, signal=None):
        plan = original(rows, settings, generator, collective, signal)
        seen.append((rows, settings, signal, plan))
        return plan

    monkeypatch.setattr(trainer_module, "plan_batch", record)
    train(model_path, make_args(tmp_path, max_steps=6))
    assert len(seen) == 6
    assert seen[0][2].rho is None and seen[0][3].metrics["compute_rule_fallback"] == 1.0
    k = seen[0][1].kept_multiple  # the layout's rounding of m (the packed layout: optimizer steps per batch)
    assert seen[0][3].m == capped_kept_count(16, int(seen[0][3].eligible.sum()), k)
    decided = 0
    for rows, _settings, signal, plan in seen[2:]:
        assert signal.rho is not None and plan.metrics["compute_rule_fallback"] == 0.0
        g = gradient_proxy(rows.advantages) * plan.eligible
        fixed, per_token = signal.costs(float(rows.generated_tokens.sum()))
        assert fixed == pytest.approx(1.2 * float(rows.generated_tokens.sum())) and per_token == 1.0
        tokens = rows.prompt_tokens + rows.completion_tokens
        expected = cheapest_kept_count(g, plan.p, tokens, signal.rho, fixed, per_token, k, "systematic")
        assert plan.rule_m == expected.m
        assert plan.m == capped_kept_count(expected.m, int(plan.eligible.sum()), k)
        assert plan.metrics["compute_cost_ratio"] == pytest.approx(expected.cost_ratio)
        decided += 1
    assert decided == 4


def test_time_model_prices_steps_in_measured_seconds(model_path, tmp_path):
    """The token model until the first window closes, then seconds: a fixed cost of generation, scoring and the
    optimizer step, and a price per kept policy token; both logged per window."""
    trainer = train(model_path, make_args(tmp_path, cost_aware_cost_model="time", max_steps=4))
    rows = step_rows(trainer)
    first = rows[0]
    assert first["cost_aware/cost_per_token"] == 1.0 and first["cost_aware/cost_fixed"] > 100  # tokens
    for row in rows[1:]:
        assert 0 < row["cost_aware/cost_fixed"] < 60 and 0 < row["cost_aware/cost_per_token"] < 1
        assert row["cost_aware/time_fixed_s"] > 0 and row["cost_aware/time_update_s"] > 0


def test_compute_state_survives_a_checkpoint(model_path, tmp_path):
    args = make_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=4)
    trainer = train(model_path, args)
    ratio = trainer._noise.ratio
    assert ratio is not None and math.isfinite(ratio)
    resumed = CostAwareGRPOTrainer(
        model_path, reward_funcs=length_reward, args=args, train_dataset=arithmetic_dataset(64, seed=0)
    )
    resumed._load_rng_state(str(tmp_path / "out" / "checkpoint-4"))
    assert resumed._noise.ratio == ratio and resumed._noise.count == trainer._noise.count


def test_other_rules_read_no_gradient(model_path, tmp_path):
    trainer = train(model_path, make_args(tmp_path, cost_aware_kept_fraction=0.5, max_steps=2))
    assert trainer._previous_grad is None
    assert not any("cost_aware/noise_grad_sq" in row for row in trainer.state.log_history)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("cost_aware_cost_model", "flops", "cost_aware_cost_model must be one of"),
        ("cost_aware_generation_token_cost", 0.0, "cost_aware_generation_token_cost"),
        ("cost_aware_noise_ema", 1.0, "cost_aware_noise_ema"),
        ("cost_aware_noise_scale_factor", -0.5, "cost_aware_noise_scale_factor"),
        ("cost_aware_token_budget", 100, "both choose the kept row count"),
        ("cost_aware_full_micro_batches", True, "needs a fixed cost_aware_kept_fraction"),
    ],
)
def test_config_refuses(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **{field: value})


def test_config_parses_the_rule_from_text(tmp_path):
    assert make_args(tmp_path, cost_aware_kept_fraction="Compute").cost_aware_kept_fraction == "compute"
    with pytest.raises(ValueError, match="'auto' or 'compute'"):
        make_args(tmp_path, cost_aware_kept_fraction="cheapest")


def test_noise_scale_factor_scales_what_the_rule_sees(model_path, tmp_path, monkeypatch):
    """factor 0: once the noise scale has an estimate, the rule sees ρ = 0 and keeps the fewest rows it may."""
    seen = []
    original = trainer_module.plan_batch

    def record(rows, settings, generator=None, collective=None, signal=None):
        plan = original(rows, settings, generator, collective, signal)
        seen.append((settings, signal, plan))
        return plan

    monkeypatch.setattr(trainer_module, "plan_batch", record)
    trainer = train(model_path, make_args(tmp_path, max_steps=4, cost_aware_noise_scale_factor=0.0))
    assert trainer._noise.ratio is not None and trainer._noise.ratio > 0  # measured, then scaled away
    for settings, signal, plan in seen[2:]:
        assert signal.rho == 0.0 and plan.rule_m == settings.kept_multiple


def test_rule_sees_the_estimators_noise_scale(model_path, tmp_path):
    """The signal handed to the plan carries the noise scale's current ratio times the factor (None before the first
    pair of steps), whatever the plan then does with it."""

    class Watching(CostAwareGRPOTrainer):
        def _init_compute_signals(self):
            super()._init_compute_signals()
            self.pairs = []

        def _compute_signal(self):
            signal = super()._compute_signal()
            self.pairs.append((self._noise.ratio, signal.rho))
            return signal

    trainer = train(model_path, make_args(tmp_path, max_steps=4, cost_aware_noise_scale_factor=0.5), Watching)
    assert trainer.pairs[0] == (None, None)
    assert all(rho == pytest.approx(0.5 * ratio) for ratio, rho in trainer.pairs[2:])
    assert len({ratio for ratio, _ in trainer.pairs[2:]}) > 1  # the estimate moves from batch to batch


@pytest.mark.parametrize("steps_per_generation,accumulation", [(2, 4), (3, 2), (2, 2)])
def test_noise_scale_is_in_rows_of_one_optimizer_step(model_path, tmp_path, steps_per_generation, accumulation):
    """`cost_aware/noise_scale` = ρ × the rows behind one optimizer step's gradient, N·G/S = per_device_batch × G on
    one process, also when G does not divide S (S = 2, G = 4: a step spans two generation batches; S = 3, G = 2: a
    generation batch spans 1.5 steps)."""
    args = make_args(
        tmp_path, steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation, max_steps=3
    )
    trainer = train(model_path, args)
    rows = [row for row in trainer.state.log_history if "cost_aware/noise_scale" in row]
    assert rows
    for row in rows:
        expected = row["cost_aware/noise_to_signal"] * args.per_device_train_batch_size * accumulation
        assert row["cost_aware/noise_scale"] == pytest.approx(expected, rel=1e-6)
