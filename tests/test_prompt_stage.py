"""Real runs of the prompt stage (`cost_aware_prompt_sampling`) on the embedded tiny model: the two-stage estimator
against the full-pool GRPOTrainer gradient, resume, refusals, degenerate batches, evaluation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_trainer import constant_reward, length_reward, make_args
from test_unbiased import _full_batch_grad
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.embedded.model import tiny_model_path as build_tiny_model_path
from trl_costaware.prompts import history as history_module
from trl_costaware.prompts.stage import INDEX_COLUMN
from trl_costaware.rows.batching import select_rows
from trl_costaware.rows.packed import NOOP_KEY

POOL, GROUP, K = 8, 4, 4  # 8 prompts of 4 rollouts; 4 prompts per generation batch, in 2 micro-batches


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model_path()


@pytest.fixture(scope="module")
def pool():
    return arithmetic_dataset(POOL, seed=3)


def prompt_args(tmp_path, **overrides):
    settings = dict(
        cost_aware_prompt_sampling=True,
        per_device_train_batch_size=K * GROUP // 2,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        num_generations=GROUP,
        cost_aware_prompt_smoothing=0.2,
    )
    settings.update(overrides)
    return make_args(tmp_path, **settings)


# ---------------------------------------------------------------- the two-stage estimator, Monte Carlo
def _strip(row):
    return {k: v for k, v in row.items() if k != INDEX_COLUMN}


def _step_grad(trainer, raw):
    """The gradient of one optimizer step (both micro-steps) on the generation batch `raw`, through the whole
    pipeline: the prompt weights, the row sampler, the layout, TRL's loss."""
    trainer.model.zero_grad()
    trainer._buffered_inputs = None
    for step in range(trainer.args.steps_per_generation):
        trainer._step = step
        micro = trainer._prepare_inputs(raw)
        if not micro.get(NOOP_KEY):  # a packed no-op has no loss token
            trainer._compute_loss(trainer.model, micro).backward()
    return torch.cat([p.grad.flatten().double() for p in trainer.model.parameters() if p.grad is not None])


def frozen_pool(trainer, monkeypatch):
    """Generate and score the whole pool once with TRL; later generations return the drawn prompts' frozen rows (and
    their rewards, as TRL's gathered rewards). Returns the full-pool batch."""
    data = trainer.train_dataset
    raw = [_strip(data[j]) for j in range(POOL) for _ in range(GROUP)]
    torch.manual_seed(0)
    full = GRPOTrainer._generate_and_score_completions(trainer, raw)
    rewards = trainer._prompt_rewards.clone()
    spread = rewards.view(POOL, GROUP).std(1)
    assert (spread > 0).sum() >= POOL // 2, "the pool needs informative groups"
    position = {data[j]["prompt"]: j for j in range(POOL)}
    assert len(position) == POOL

    def generate(self, inputs):
        seen: dict[int, int] = {}
        rows = []
        for x in inputs:
            j = position[x["prompt"]]
            rows.append(j * GROUP + seen.get(j, 0))
            seen[j] = seen.get(j, 0) + 1
        idx = torch.tensor(rows)
        sub = select_rows(full, idx)
        mask = sub["completion_mask"]
        sub["num_items_in_batch"] = mask.sum().to(full["num_items_in_batch"].dtype)  # TRL's, for this batch
        self._prompt_rewards = rewards[idx]
        return sub

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", generate)
    return full


def skewed_history(trainer, frozen=True):
    """A history far from uniform: half the prompts look solved, costs differ; frozen (no update is applied), or
    with the trainer's own lag (the lag path: every batch's update is applied two draws later, the prior refitted
    at each epoch's plan)."""
    h = trainer._prompt_history
    if frozen:
        h.lag = 10**9
    h.seen[:] = True
    h.ea[: POOL // 2], h.eb[: POOL // 2] = 400.0, 0.0
    h.prompt[:] = torch.arange(POOL, dtype=torch.float64) + 4
    h.completion[:] = 8.0
    return h


def monte_carlo(trainer, draws):
    h = trainer._prompt_history
    grads = []
    for t in range(draws):
        rec = h.draw(t, K)
        raw = [trainer.train_dataset[j] for j in rec.indices for _ in range(GROUP)]
        grads.append(_step_grad(trainer, raw))
    return torch.stack(grads)


def bias_along(grads, target):
    """(E[ĝ]·g/‖g‖² − 1, its standard error, ‖mean − g‖² / (tr Cov / D))."""
    proj = grads @ target / target.dot(target)
    z = float((grads.mean(0) - target).pow(2).sum() / (grads.var(0).sum() / len(grads)))
    return float(proj.mean() - 1), float(proj.std() / math.sqrt(len(grads))), z


@pytest.mark.parametrize(
    "loss_type,cost_aware,tolerance,frozen",
    [
        ("grpo", True, 0.0, True),
        ("grpo", False, 0.0, True),
        ("dapo", True, 0.03, True),
        ("bnpo", True, 0.03, True),
        ("cispo", True, 0.03, True),
        ("vespo", True, 0.03, True),
        ("grpo", True, 0.0, False),
    ],
    ids=["grpo-both", "grpo-prompts", "dapo-both", "bnpo-both", "cispo-both", "vespo-both", "grpo-both-lag"],
)
def test_two_stage_estimator_is_unbiased_for_the_full_pool(
    tmp_path, model_path, pool, monkeypatch, loss_type, cost_aware, tolerance, frozen
):
    """E[ĝ] = the full-pool GRPOTrainer gradient (TRL's loss on every prompt's group as one batch), with two
    micro-batches per optimizer step, a history far from uniform, balanced epochs and, with cost_aware, the row
    sampler on top. grpo is exact; the token-normalised losses' normaliser is a ratio estimate (an O(1/K) bias,
    bounded here by `tolerance`). `frozen=False` is the lag path: the history learns from every batch through the
    trainer's lag, so each epoch's q differs."""
    args = prompt_args(tmp_path, loss_type=loss_type, cost_aware=cost_aware, max_completion_length=12)
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=pool)
    trainer.model.train()
    full = frozen_pool(trainer, monkeypatch)
    target = _full_batch_grad(trainer, full)
    h = skewed_history(trainer, frozen=frozen)
    q = h.distribution(*h.predictions()[::2])
    assert q.max() / q.min() > 3, "the test needs a prompt distribution far from uniform"
    grads = monte_carlo(trainer, 240)
    if not frozen:  # the updates went in through the lag and moved q from epoch to epoch
        assert h.applied == 240 - 1 - h.lag - 1 and h.lag == 2
        plans = {t: tuple(round(w, 6) for w in r.weights.tolist()) for t, r in h.records.items()}
        assert len(set(plans.values())) > 2
    bias, se, z = bias_along(grads, target)
    print(f"{loss_type} cost_aware={cost_aware} frozen={frozen}: bias along g {bias:+.4f} ± {se:.4f}, z {z:.2f}")
    assert abs(bias) <= tolerance + 4 * se, (bias, se, z)
    assert z < 4.0 or abs(bias) <= tolerance, (bias, se, z)


def test_forced_weights_are_detected(tmp_path, model_path, pool, monkeypatch):
    """The control: the same draws with every prompt weight forced to 1 must be detected as biased."""
    args = prompt_args(tmp_path, loss_type="grpo", cost_aware=True, max_completion_length=12)
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=pool)
    trainer.model.train()
    full = frozen_pool(trainer, monkeypatch)
    target = _full_batch_grad(trainer, full)
    skewed_history(trainer)
    layout = history_module.epoch_layout

    def forced(q, k, draws, generator):  # the layout follows q, but the weights K / (P π) see π = K / P
        idx, pi = layout(q, k, draws, generator)
        return idx, torch.full_like(pi, k / len(pi))

    monkeypatch.setattr(history_module, "epoch_layout", forced)
    bias, se, z = bias_along(monte_carlo(trainer, 240), target)
    print(f"weights forced to 1: bias along g {bias:+.4f} ± {se:.4f}, z {z:.2f}")
    assert abs(bias) > 6 * se and z > 10, (bias, se, z)


# ---------------------------------------------------------------- runs
def last_metric(trainer, key):
    values = [row[key] for row in trainer.state.log_history if key in row]
    assert values, f"{key} never logged"
    return values[-1]


def test_reward_functions_never_see_the_index_and_metrics_are_logged(tmp_path, model_path, pool):
    seen_keys = set()

    def reward(completions, **kwargs):
        seen_keys.update(kwargs)
        return length_reward(completions)

    args = prompt_args(tmp_path, max_steps=4)
    trainer = CostAwareGRPOTrainer(model_path, [reward], args=args, train_dataset=pool)
    trainer.train()
    assert INDEX_COLUMN not in seen_keys and "answer" in seen_keys
    for key in ("zero_variance_token_share", "prompt_weight_ess_fraction", "prompt_predicted_zero_variance"):
        assert f"cost_aware/{key}" in trainer.state.log_history[-2]
    assert trainer._prompt_history.taken == 3 and trainer._prompt_history.seen.sum() > 0


def test_remove_unused_columns_keeps_the_index(tmp_path, model_path, pool):
    args = prompt_args(tmp_path, max_steps=2, remove_unused_columns=True)
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=pool)
    trainer.train()
    assert trainer._prompt_history.taken == 1


@pytest.mark.parametrize("case", ["constant", "truncated"])
def test_degenerate_batches_train_on(tmp_path, model_path, pool, case):
    """Every group zero-variance (no gradient anywhere), or every completion truncated and masked: it trains on, and
    the logs show it."""
    if case == "constant":
        args, reward = prompt_args(tmp_path, max_steps=3), constant_reward
    else:
        args = prompt_args(tmp_path, max_steps=3, max_completion_length=2, mask_truncated_completions=True)
        reward = length_reward
    trainer = CostAwareGRPOTrainer(model_path, [reward], args=args, train_dataset=pool)
    trainer.train()
    assert trainer.state.global_step == 3
    if case == "constant":
        assert last_metric(trainer, "cost_aware/zero_variance_token_share") == 1.0
        assert bool(trainer._prompt_history.last_zero_variance[trainer._prompt_history.seen].all())


def test_evaluation_is_untouched(tmp_path, model_path, pool):
    """The eval dataset has no index column and its sampler is TRL's; evaluate() returns GRPOTrainer's keys."""
    args = prompt_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    trainer = CostAwareGRPOTrainer(
        model_path, [length_reward], args=args, train_dataset=pool, eval_dataset=arithmetic_dataset(8, seed=9)
    )
    trainer.train()
    assert INDEX_COLUMN not in trainer.eval_dataset.column_names
    assert not any("prompt_" in k for k in trainer.evaluate())


def _draws(trainer):
    return {t: (r.indices, r.weights.tolist()) for t, r in trainer._prompt_history.records.items()}


def test_resume_reproduces_the_draws(tmp_path, model_path, pool):
    """A run resumed from its step-2 checkpoint makes the uninterrupted run's draws (and weights) from there on."""
    common = dict(max_steps=6, save_strategy="steps", save_steps=2, seed=7)
    whole = CostAwareGRPOTrainer(
        model_path, [length_reward], args=prompt_args(tmp_path / "a", **common), train_dataset=pool
    )
    whole.train()
    resumed = CostAwareGRPOTrainer(
        model_path, [length_reward], args=prompt_args(tmp_path / "b", **common), train_dataset=pool
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    a, b = _draws(whole), _draws(resumed)
    later = [t for t in a if t >= 2]
    assert later and all(a[t][0] == b[t][0] for t in later)
    assert all(torch.allclose(torch.tensor(a[t][1]), torch.tensor(b[t][1])) for t in later)
    assert any(not torch.allclose(torch.tensor(a[t][1]), torch.ones(K)) for t in later)  # the history acted
    ha, hb = whole._prompt_history, resumed._prompt_history
    assert ha.applied == hb.applied and ha.taken == hb.taken
    assert torch.allclose(ha.a, hb.a) and torch.allclose(ha.b, hb.b)


# ---------------------------------------------------------------- refusals
def test_iterable_dataset_is_refused(tmp_path, model_path, pool):
    args = prompt_args(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="cost_aware_prompt_sampling"):
        CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=pool.to_iterable_dataset())


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("cost_aware_prompt_smoothing", 0.0, "cost_aware_prompt_smoothing"),
        ("cost_aware_prompt_smoothing", 1.5, "cost_aware_prompt_smoothing"),
        ("cost_aware_prompt_forgetting", -0.1, "cost_aware_prompt_forgetting"),
        ("scale_rewards", "batch", "scale_rewards"),
        ("multi_objective_aggregation", "normalize_then_sum", "multi_objective_aggregation"),
    ],
)
def test_config_refusals_name_the_field(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        CostAwareGRPOConfig(output_dir=str(tmp_path), use_cpu=True, cost_aware_prompt_sampling=True, **{field: value})


def test_the_greso_rule_trains_with_unit_weights(tmp_path, model_path, pool):
    """The benchmark's GRESO rule through the trainer: it trains, every weight is 1, its counters move."""
    args = prompt_args(tmp_path, max_steps=4)
    trainer = CostAwareGRPOTrainer(model_path, [constant_reward], args=args, train_dataset=pool)
    trainer._prompt_history.rule = "greso"
    trainer.train()
    h = trainer._prompt_history
    assert trainer.state.global_step == 4 and h.taken == 3
    assert all(torch.equal(r.weights, torch.ones(K, dtype=torch.float64)) for r in h.records.values())
    assert h.streak.max() >= 1 and h.greso_p[0] != 0.5  # constant rewards: every visit zero-variance and "easy"
