"""The GPU path: real cost-aware runs on CUDA in bf16, and the Monte Carlo unbiasedness check on CUDA.

Skipped without CUDA (every CI machine); run with `make test-gpu` on a GPU machine. The CPU guard against the
host/device bugs these runs would hit is `tests/test_device.py`.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from testing_utils import LOSS_TYPES, fixed_batch, last_metric, length_reward, make_config, weights_of
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)"),
]


def _args(tmp_path, **overrides):
    """The suite's tiny run, on the GPU in bf16."""
    return make_config(tmp_path, **{"use_cpu": False, "bf16": True, "max_completion_length": 16, **overrides})


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


RUNS = {f"loss={lt}": dict(loss_type=lt) for lt in LOSS_TYPES}
RUNS["loss=luspo"]["importance_sampling_level"] = "sequence"
RUNS.update(
    {
        "default": {},
        "beta": dict(beta=0.04),
        "beta-dapo": dict(loss_type="dapo", beta=0.04),
        "num_iterations=2": dict(num_iterations=2, steps_per_generation=2, gradient_accumulation_steps=1),
        "spg=2xGA": dict(steps_per_generation=4, gradient_accumulation_steps=2),
        "token-budget": dict(cost_aware_token_budget=80),
        "weights-recenter": dict(cost_aware_weight_normalization="recenter"),  # the default is "none"
        "proxy-loss-aware": dict(cost_aware_proxy="loss_aware"),
    }
)


@pytest.mark.parametrize("overrides", list(RUNS.values()), ids=list(RUNS))
def test_two_step_run_bf16(tmp_path, warm_model_path, dataset, overrides):
    trainer = CostAwareGRPOTrainer(
        warm_model_path, [length_reward], args=_args(tmp_path, **overrides), train_dataset=dataset
    )
    assert trainer.model.device.type == "cuda"
    before = weights_of(trainer.model)
    trainer.train()
    assert not torch.equal(before, weights_of(trainer.model))
    assert math.isfinite(last_metric(trainer, "loss"))
    assert last_metric(trainer, "cost_aware/kept_row_fraction") < 1.0
    assert last_metric(trainer, "cost_aware/policy_tokens") < last_metric(trainer, "cost_aware/rollout_tokens")


def test_lora_bf16(tmp_path, warm_model_path, dataset):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = CostAwareGRPOTrainer(
        warm_model_path,
        [length_reward],
        args=_args(tmp_path, beta=0.04),
        train_dataset=dataset,
        peft_config=peft_config,
    )
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert any(not torch.equal(p, lora[n]) for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_first_micro_step_ratio_is_one_bf16(tmp_path, warm_model_path, dataset):
    """steps_per_generation = 2 × gradient accumulation: the deferred old-policy pass and the policy pass of the first
    micro-step see the same model, so their log-probs must be identical (TRL's own ratio is exactly 1 there)."""
    args = _args(tmp_path, steps_per_generation=4, gradient_accumulation_steps=2, max_steps=1)
    trainer = CostAwareGRPOTrainer(warm_model_path, [length_reward], args=args, train_dataset=dataset)
    seen = []
    original = trainer._compute_loss

    def record(model, inputs):
        if not seen:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            with torch.no_grad():
                new = trainer._get_per_token_logps_and_entropies(
                    model, ids, mask, inputs["completion_ids"].size(1), batch_size=len(ids)
                )[0]
            keep = inputs["completion_mask"].bool()
            seen.append(float((new - inputs["old_per_token_logps"])[keep].abs().max()))
        return original(model, inputs)

    trainer._compute_loss = record
    trainer.train()
    assert seen and seen[0] == 0.0, seen


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_cost_aware_gradient_is_unbiased_on_cuda(tmp_path, tiny_model_path, dataset, loss_type, monkeypatch):
    """Float32 on CUDA: the mean of the cost-aware gradient over draws matches the full-batch GRPOTrainer gradient,
    and weights forced to 1 are detected as biased."""
    args = _args(
        tmp_path,
        bf16=False,
        per_device_train_batch_size=16,
        loss_type=loss_type,
        cost_aware_kept_fraction=0.5,
        cost_aware_smoothing=0.2,
    )
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    raw_inputs = [dataset[i] for i in range(16)]
    full = GRPOTrainer._generate_and_score_completions(trainer, raw_inputs)
    assert full["advantages"].is_cuda and full["advantages"].abs().sum() > 0
    target = _grad(trainer, full).double()
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fixed_batch(full))
    grads = _mc_gradients(trainer, raw_inputs, 400)
    assert _z_score(grads, target) < 6.0

    original = trainer._draw_kept_rows

    def unweighted(batch):
        plan = original(batch)
        return dataclasses.replace(plan, factors=torch.ones_like(plan.factors))

    monkeypatch.setattr(trainer, "_draw_kept_rows", unweighted)
    assert _z_score(_mc_gradients(trainer, raw_inputs, 400), target) > 30.0
