"""Real runs of CostAwareGRPOTrainer on the embedded tiny model (CPU, single process)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset, arithmetic_reward
from trl_costaware.embedded.model import tiny_model_path as build_tiny_model_path


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model_path()


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=0)


def length_reward(completions, **kwargs):
    """Reward with within-group variance for an untrained model: completion length mod 4."""
    return [float(len(c) % 4) for c in completions]


def constant_reward(completions, **kwargs):
    return [1.0 for _ in completions]


def make_args(tmp_path, cls=CostAwareGRPOConfig, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        seed=0,
        learning_rate=1e-3,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def weights_of(model):
    return torch.cat([p.detach().flatten().float().clone() for p in model.parameters()])


def last_metric(trainer, key):
    values = [row[key] for row in trainer.state.log_history if key in row]
    assert values, f"{key} never logged"
    return values[-1]


# ---------------------------------------------------------------- unbiasedness
LOSS_SETTINGS = {
    "grpo": {},
    "bnpo": {},
    "dr_grpo": {},
    "dapo": {},
    "cispo": {},
    "sapo": {},
    "luspo": {"importance_sampling_level": "sequence"},
    "vespo": {},
}


def fixed_batch(batch):
    """A stand-in for GRPOTrainer._generate_and_score_completions returning one fixed batch (cloned each call)."""

    def generate_and_score(trainer, inputs):
        return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) for k, v in batch.items()}

    return generate_and_score


def _grad(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return torch.cat([p.grad.flatten().clone() for p in trainer.model.parameters() if p.grad is not None])


def _mc_gradients(trainer, raw_inputs, draws):
    grads = []
    for _ in range(draws):
        trainer._buffered_inputs = None
        trainer._step = 0
        micro = trainer._prepare_inputs(raw_inputs)
        grads.append(_grad(trainer, micro))
    return torch.stack(grads).double()


def _z_score(grads, target):
    """‖mean − target‖² / (tr Cov / K): about 1 for an unbiased estimator, growing like K·bias² otherwise."""
    k = len(grads)
    err = (grads.mean(0) - target).pow(2).sum()
    var = grads.var(0).sum() / k
    return float(err / var)


@pytest.mark.parametrize("loss_type", list(LOSS_SETTINGS))
def test_cost_aware_gradient_is_unbiased(tmp_path, model_path, dataset, loss_type, monkeypatch):
    """Mean over many draws of the cost-aware gradient (normalisation "none") → full-batch GRPOTrainer gradient."""
    common = dict(
        per_device_train_batch_size=16,
        num_generations=4,
        loss_type=loss_type,
        cost_aware_kept_fraction=0.5,
        cost_aware_smoothing=0.2,
        **LOSS_SETTINGS[loss_type],
    )
    trainer = CostAwareGRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path, **common), train_dataset=dataset
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop, which we bypass here
    raw_inputs = [dataset[i] for i in range(16)]
    full = GRPOTrainer._generate_and_score_completions(trainer, raw_inputs)
    assert full["advantages"].abs().sum() > 0
    target = _grad(trainer, full).double()

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fixed_batch(full))
    grads = _mc_gradients(trainer, raw_inputs, 400)
    z = _z_score(grads, target)
    rel = [float((grads[:k].mean(0) - target).norm() / target.norm()) for k in (25, 400)]
    assert z < 6.0, f"{loss_type}: z={z:.2f}, relative errors {rel}"
    assert rel[1] < rel[0], f"{loss_type}: error does not shrink with draws: {rel}"

    # Negative control: the same draws with every importance factor set to 1 are biased, and the test detects it.
    if loss_type == "grpo":
        original = trainer._draw_kept_rows

        def unweighted(batch):
            idx, factors = original(batch)
            return idx, torch.ones_like(factors)

        monkeypatch.setattr(trainer, "_draw_kept_rows", unweighted)
        biased = _mc_gradients(trainer, raw_inputs, 400)
        assert _z_score(biased, target) > 30.0


# ---------------------------------------------------------------- forward accounting
def test_dropped_rows_never_reach_a_forward(tmp_path, model_path, dataset):
    """After generation, forward passes (old-policy, reference, policy) see only kept rows, trimmed to width."""
    args = make_args(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=4,
        gradient_accumulation_steps=2,  # misaligned with steps_per_generation → TRL needs old-policy log-probs
        beta=0.05,  # → reference log-probs
        max_steps=2,
        cost_aware_kept_fraction=0.5,
    )
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=dataset)
    seen = []

    def hook(module, args_, kwargs):
        if "labels" in kwargs:  # TRL's log-prob passes; generation calls the model without labels
            seen.append((kwargs["input_ids"].shape, kwargs["attention_mask"].clone(), torch.is_grad_enabled()))

    # The reference model is a separate module when beta > 0 and there is no PEFT adapter.
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in (trainer.model, trainer.ref_model)]
    trainer.train()
    for h in handles:
        h.remove()

    n, m = 8 * 4, 16  # generation batch rows per rank, kept rows
    no_grad_rows = sum(shape[0] for shape, _, grad in seen if not grad)
    grad_rows = sum(shape[0] for shape, _, grad in seen if grad)
    # One generation: old-policy pass + reference pass over the kept rows only (never the n generated rows).
    assert no_grad_rows == 2 * m, no_grad_rows
    # Two optimizer steps × 2 micro-steps × m / steps_per_generation rows.
    assert grad_rows == 2 * 2 * (m // 4), grad_rows
    for _, mask, grad in seen:
        if grad:  # each micro-batch is trimmed to its own longest row: first and last columns are used
            assert mask[:, 0].any() and mask[:, -1].any()
    assert last_metric(trainer, "cost_aware/batch_rows_kept") == m
    assert last_metric(trainer, "cost_aware/batch_rows_generated") == n
    assert last_metric(trainer, "cost_aware/rows_generated") == n  # cumulative, one generation batch
    assert last_metric(trainer, "cost_aware/rows_kept") == m


def test_micro_batches_trimmed_and_grouped_by_length(tmp_path, model_path, dataset):
    args = make_args(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        max_steps=1,
        cost_aware_kept_fraction=1.0,
        cost_aware_group_by_length=True,
    )
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=dataset)
    widths = []
    trainer.model.register_forward_pre_hook(
        lambda mod, a, kw: widths.append(kw["attention_mask"].sum(-1).tolist()) if "labels" in kw else None,
        with_kwargs=True,
    )
    trainer.train()
    # Grouped: row lengths of different micro-batches do not interleave.
    ranges = sorted((min(w), max(w)) for w in widths)
    for (_, hi1), (lo2, _) in zip(ranges, ranges[1:], strict=False):
        assert hi1 <= lo2
    padded, real = (
        last_metric(trainer, "cost_aware/policy_tokens_padded"),
        last_metric(trainer, "cost_aware/policy_tokens"),
    )
    assert real == sum(sum(w) for w in widths)
    assert padded >= real


# ---------------------------------------------------------------- equivalence
def test_switched_off_equals_grpo_trainer(tmp_path, model_path, dataset):
    common = dict(max_steps=3, beta=0.02)
    base = GRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path / "a", cls=GRPOConfig, **common), train_dataset=dataset
    )
    base.train()
    off = CostAwareGRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path / "b", cost_aware=False, **common), train_dataset=dataset
    )
    off.train()
    base_losses = [r["loss"] for r in base.state.log_history if "loss" in r]
    off_losses = [r["loss"] for r in off.state.log_history if "loss" in r]
    assert base_losses == off_losses
    assert torch.equal(weights_of(base.model), weights_of(off.model))
    assert last_metric(off, "cost_aware/policy_tokens") > 0  # the baseline arm still logs its token counters


def test_kept_fraction_one_uniform_matches_grpo_loss(tmp_path, model_path, dataset):
    """Keeping every row with equal weights reproduces GRPO's first loss (same generation, rows reordered)."""
    base = GRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path / "a", cls=GRPOConfig, max_steps=1), train_dataset=dataset
    )
    base.train()
    full = CostAwareGRPOTrainer(
        model_path,
        [length_reward],
        args=make_args(tmp_path / "b", max_steps=1, cost_aware_kept_fraction=1.0, cost_aware_proxy="uniform"),
        train_dataset=dataset,
    )
    full.train()
    assert math.isclose(last_metric(base, "loss"), last_metric(full, "loss"), rel_tol=1e-4, abs_tol=1e-6)


# ---------------------------------------------------------------- features
@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_iterations=2),
        dict(steps_per_generation=4, gradient_accumulation_steps=2),
        dict(cost_aware_draw="multinomial"),
        dict(cost_aware_weight_normalization="recenter"),
        dict(cost_aware_weight_normalization="self_normalize", cost_aware_weight_cap=2.0),
        dict(cost_aware_token_budget=60),
        dict(cost_aware_cost="completion", cost_aware_proxy="inverse_sqrt_cost"),
        dict(loss_type="dapo", beta=0.05),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_feature_runs(tmp_path, model_path, dataset, overrides):
    trainer = CostAwareGRPOTrainer(
        model_path, [length_reward, arithmetic_reward], args=make_args(tmp_path, **overrides), train_dataset=dataset
    )
    before = weights_of(trainer.model)
    trainer.train()
    assert not torch.equal(before, weights_of(trainer.model))
    assert last_metric(trainer, "cost_aware/count_check") == 0
    ess = last_metric(trainer, "cost_aware/weight_ess")
    m = last_metric(trainer, "cost_aware/kept_row_fraction") * last_metric(trainer, "cost_aware/batch_rows_generated")
    assert 0 < ess <= m + 1e-6  # ESS ≤ number of weights
    for key in ("j_ratio_ideal", "j_ratio_achieved", "kept_token_fraction", "informative_fraction"):
        assert math.isfinite(last_metric(trainer, f"cost_aware/{key}"))
    # Rollout tokens count prompt + completion whatever the sampling cost is made of.
    assert last_metric(trainer, "cost_aware/rollout_tokens") > last_metric(trainer, "cost_aware/generated_tokens")
    if "cost_aware_token_budget" in overrides:
        assert last_metric(trainer, "cost_aware/kept_row_fraction") < 1.0


def test_lora(tmp_path, model_path, dataset):
    from peft import LoraConfig

    args = make_args(tmp_path, beta=0.05)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = CostAwareGRPOTrainer(
        model_path, [length_reward], args=args, train_dataset=dataset, peft_config=peft_config
    )
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if "lora_B" in n and not torch.equal(p, lora[n])]
    assert changed
    assert last_metric(trainer, "cost_aware/kept_row_fraction") == 0.5


def test_conversational_prompts(tmp_path, model_path):
    ds = arithmetic_dataset(32, seed=1, conversational=True)
    trainer = CostAwareGRPOTrainer(
        model_path, [arithmetic_reward, length_reward], args=make_args(tmp_path), train_dataset=ds
    )
    trainer.train()
    assert last_metric(trainer, "cost_aware/count_check") == 0


def test_resume_draws_the_same_rows(tmp_path, model_path, dataset):
    common = dict(
        max_steps=4, save_strategy="steps", save_steps=2, steps_per_generation=2, gradient_accumulation_steps=1
    )
    straight = CostAwareGRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path / "a", **common), train_dataset=dataset
    )
    straight.train()
    resumed = CostAwareGRPOTrainer(
        model_path, [length_reward], args=make_args(tmp_path / "a", **common), train_dataset=dataset
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    torch.testing.assert_close(weights_of(straight.model), weights_of(resumed.model))
    assert last_metric(straight, "cost_aware/policy_tokens") == last_metric(resumed, "cost_aware/policy_tokens")


# ---------------------------------------------------------------- degenerate batches
def test_all_rewards_equal(tmp_path, model_path, dataset):
    trainer = CostAwareGRPOTrainer(
        model_path, [constant_reward], args=make_args(tmp_path, beta=0.0), train_dataset=dataset
    )
    before = weights_of(trainer.model)
    trainer.train()
    assert last_metric(trainer, "cost_aware/informative_fraction") == 0.0
    assert last_metric(trainer, "cost_aware/zero_signal_ranks") == 1.0
    assert last_metric(trainer, "cost_aware/j_ratio_ideal") == 1.0
    # Zero advantages: the policy term is zero, so an Adam step moves nothing.
    torch.testing.assert_close(before, weights_of(trainer.model))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_one_token_and_truncated_completions(tmp_path, model_path, dataset, mask_truncated):
    args = make_args(tmp_path, max_completion_length=1, mask_truncated_completions=mask_truncated)
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.train()
    assert last_metric(trainer, "cost_aware/count_check") == 0
    assert math.isfinite(last_metric(trainer, "loss"))


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cost_aware_kept_fraction", 0.0),
        ("cost_aware_kept_fraction", 1.5),
        ("cost_aware_token_budget", 0),
        ("cost_aware_proxy", "gradient"),
        ("cost_aware_cost", "flops"),
        ("cost_aware_cost", "no_such_module_xyz:fn"),
        ("cost_aware_smoothing", -0.1),
        ("cost_aware_smoothing", 1.1),
        ("cost_aware_draw", "poisson"),
        ("cost_aware_weight_normalization", "softmax"),
        ("cost_aware_weight_floor", -1.0),
        ("cost_aware_weight_cap", 0.0),
    ],
)
def test_config_errors_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        make_args(tmp_path, **{field: value})


def test_plain_grpo_config_is_rejected(tmp_path, model_path, dataset):
    with pytest.raises(TypeError, match="CostAwareGRPOConfig"):
        CostAwareGRPOTrainer(
            model_path, [length_reward], args=make_args(tmp_path, cls=GRPOConfig), train_dataset=dataset
        )


def test_cost_callable_and_import_path(tmp_path, model_path, dataset):
    calls = []

    def flops(prompt_mask, completion_mask):
        calls.append(len(prompt_mask))
        return (prompt_mask.sum(-1) + 2 * completion_mask.sum(-1)).float()

    args = make_args(tmp_path, cost_aware_cost="trl_costaware.sampling:sequence_costs")
    args.cost_aware_cost = flops  # a callable works from Python
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.train()
    assert calls


def test_model_loads_by_path_like_a_hub_id(model_path):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_vllm_importance_sampling_path_defers_only_the_reference_pass(tmp_path, model_path, dataset):
    """With vLLM IS correction, TRL consumes the old-policy log-probs of every row at once: that first pass runs for
    real, and the reference pass is still deferred to the kept rows (code path only; vLLM itself needs a GPU)."""
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=make_args(tmp_path), train_dataset=dataset)
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    ids = torch.randint(4, 50, (2, 6))
    mask = torch.ones_like(ids)
    with trainer._deferred_scoring_logps() as calls:
        old, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
    assert old is not None and old.shape == (2, 3)
    assert ref is None
    assert calls == ["computed", "deferred"]
    assert "_get_per_token_logps_and_entropies" not in vars(trainer)  # the method is restored
