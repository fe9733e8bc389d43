"""Device discipline without a GPU: the cost-aware post-processing run on a batch that lives on an (emulated)
accelerator must keep everything it returns there, and copy the sampler's inputs to the host once."""

from __future__ import annotations

import copy

import pytest
import torch
from fake_device import FAKE, FakeAccelerator, is_marked, mark
from testing_utils import make_trainer
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from trl_costaware.rows.plan import Plan
from trl_costaware.trainer import GenerationBatch


def test_fake_accelerator_catches_mixing():
    """The emulation itself: mixing a device tensor with a host vector fails like CUDA; scalars and host indices
    do not; moving with .to(device) fixes it; transfers to the host are counted."""
    mode = FakeAccelerator()
    with mode:
        x = mark(torch.ones(4))
        assert x.device == FAKE
        with pytest.raises(RuntimeError, match="same device"):
            x * torch.ones(4)
        y = x * torch.tensor(2.0)  # host 0-dim scalars mix freely
        assert is_marked(y) and is_marked(x[torch.tensor([0, 2])])
        z = x * torch.ones(4).to(x.device)
        assert is_marked(z) and is_marked(torch.zeros(2, device=x.device))
        assert not is_marked(z.cpu()) and float(z.sum()) == 4.0
    assert mode.transfers == 2


def _post_process(trainer, dataset, monkeypatch, n_rows):
    """Run the trainer's batch post-processing on a real generation batch whose tensors live on the emulated device.
    Returns the batch, the keys moved off the device, and the device→host transfers: the sampler's
    (`_draw_kept_rows`) and the whole post-processing's (`_generate_and_score_completions` after TRL)."""
    trainer.model.train()
    raw = [dataset[i] for i in range(n_rows)]
    full = GRPOTrainer._generate_and_score_completions(trainer, raw)
    assert full["advantages"].abs().sum() > 0

    def on_device(_self, _inputs):
        return {k: mark(v.clone()) if isinstance(v, torch.Tensor) else copy.copy(v) for k, v in full.items()}

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", on_device)
    mode = FakeAccelerator()
    transfers = {}
    original = trainer._draw_kept_rows

    def counted(batch):  # device→host transfers made by the sampler (statistics, plan, metrics)
        before = mode.transfers
        out = original(batch)
        transfers["sampler"] = mode.transfers - before
        return out

    monkeypatch.setattr(trainer, "_draw_kept_rows", counted)
    with mode:
        batch = trainer._generate_and_score_completions(raw)
        misplaced = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device != FAKE]
    transfers["post_processing"] = mode.transfers
    return batch, misplaced, transfers


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"loss_type": "bnpo"},
        {"loss_type": "dapo", "beta": 0.04},
        {"cost_aware_token_budget": 60},
        {"cost_aware_weight_normalization": "recenter", "cost_aware_proxy": "loss_aware"},
        {"cost_aware_cost": "test_device:costs_on_host"},
    ],
    ids=["default", "bnpo", "dapo-kl", "token-budget", "recenter-loss-aware", "host-cost-callable"],
)
def test_post_processing_keeps_the_batch_on_its_device(tmp_path, tiny_model_path, dataset, monkeypatch, overrides):
    trainer = make_trainer(tiny_model_path, tmp_path, dataset=dataset, max_steps=1, **overrides)
    batch, misplaced, transfers = _post_process(trainer, dataset, monkeypatch, 8)
    assert not misplaced, f"moved off the batch's device: {misplaced}"
    # One device→host copy of the sampler's inputs per generation batch, and nothing else after TRL (single process:
    # no collective either).
    assert transfers == {"sampler": 1, "post_processing": 1}, transfers
    assert len(batch["advantages"]) < 8  # rows were dropped


def costs_on_host(prompt_mask, completion_mask):
    """A user cost callable that returns a host list (allowed): the trainer must move it to the batch's device. (It
    reads only shapes, so the transfers counted are the trainer's.)"""
    return [float(prompt_mask.shape[1] + i) for i in range(len(prompt_mask))]


@pytest.mark.slow
def test_deferred_log_prob_passes_on_device(tmp_path, tiny_model_path, dataset, monkeypatch):
    """With old-policy and reference passes deferred to the kept rows, the model runs on device inputs: the model's
    parameters are marked as device tensors, so a host tensor reaching the forward fails."""
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        dataset=dataset,
        max_steps=1,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
        beta=0.04,
    )
    for module in (trainer.model, trainer.ref_model):
        for t in list(module.parameters()) + list(module.buffers()):
            mark(t)
    batch, misplaced, _ = _post_process(trainer, dataset, monkeypatch, 16)
    assert not misplaced, f"moved off the batch's device: {misplaced}"
    # The deferred passes run per micro-batch, when the trainer processes TRL's freshly split buffer.
    with FakeAccelerator():
        trainer._buffered_inputs = split_tensor_dict(batch, 2)
        trainer._process_new_buffer()
        chunks = trainer._buffered_inputs
        misplaced = [k for c in chunks for k, v in c.items() if isinstance(v, torch.Tensor) and v.device != FAKE]
    assert not misplaced, f"moved off the batch's device: {misplaced}"
    assert all(c["old_per_token_logps"] is not None and c["ref_per_token_logps"] is not None for c in chunks)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "overrides"),
    [
        ("packed", {}),
        ("even", {}),
        ("packed", {"loss_type": "bnpo"}),
        ("even", {"loss_type": "bnpo"}),
        ("even", {"pad_to_multiple_of": 4}),
        (
            "packed",
            {"loss_type": "dapo", "beta": 0.04, "mask_truncated_completions": True, "max_completion_length": 6},
        ),
    ],
    ids=["packed", "even", "packed-bnpo", "even-bnpo", "even-pad4", "packed-dapo-kl-truncation"],
)
def test_micro_batch_processing_makes_no_transfer(tmp_path, tiny_model_path, dataset, monkeypatch, layout, overrides):
    """`_process_new_buffer` (packing or TRL's split, trimming, bnpo correction, counters) reads the micro-batches'
    widths and tokens from the host statistics the plan already has: no device→host transfer (it made ~3 per
    micro-batch plus one per micro-batch for the token counter). The deferred passes are stubbed (they are the
    model's forward)."""
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        dataset=dataset,
        layout=layout,
        max_steps=1,
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        **overrides,
    )
    batch, _, _ = _post_process(trainer, dataset, monkeypatch, 16)
    monkeypatch.setattr(trainer, "_compute_deferred_logps", lambda chunk: None)
    mode = FakeAccelerator()
    with mode:
        trainer._buffered_inputs = split_tensor_dict(batch, 4)
        trainer._process_new_buffer()
        chunks = trainer._buffered_inputs
        misplaced = [k for c in chunks for k, v in c.items() if isinstance(v, torch.Tensor) and v.device != FAKE]
    assert mode.transfers == 0, mode.transfers
    assert not misplaced, misplaced
    for c in chunks:  # trimmed to the longest row (rounded up to pad_to_multiple_of)
        multiple = overrides.get("pad_to_multiple_of", 1)
        assert c["completion_ids"].shape[1] == max(
            1, -(-int(c["completion_mask"].sum(-1).max()) // multiple) * multiple
        )
        assert "cost_aware_rows" not in c
    trained = trainer._cost_aware.generation.trained  # added to the totals as each micro-step trains
    assert sum(t["policy_tokens_padded"] for t in trained) >= sum(t["policy_tokens"] for t in trained) > 0


def test_micro_and_optimizer_steps_make_no_transfer(tmp_path, tiny_model_path, dataset, monkeypatch):
    """Per micro-step (`_compute_loss`, with the KL rescale of a token-sum loss) and per optimizer step (TRL's
    `_clip_grad_norm`, not overridden) the trainer adds no transfer."""
    trainer = make_trainer(
        tiny_model_path, tmp_path, dataset=dataset, max_steps=1, loss_type="dapo", beta=0.04, max_grad_norm=1.0
    )
    trainer.model.train()
    betas = []

    def loss(self, model, inputs):
        betas.append(self.beta)
        return mark(torch.tensor(0.5))

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", loss)
    monkeypatch.setattr(GRPOTrainer, "_clip_grad_norm", lambda self, model: mark(torch.tensor(2.0)))
    plan = Plan(torch.arange(1), torch.ones(1), kl_scale=1.5)  # as the plan of a dapo generation batch sets it
    trainer._cost_aware.generation = GenerationBatch({}, plan=plan)
    mode = FakeAccelerator()
    with mode:
        for _ in range(3):
            trainer._compute_loss(trainer.model, {})
            trainer._clip_grad_norm(trainer.model)
    assert mode.transfers == 0, mode.transfers
    assert betas == [pytest.approx(0.06)] * 3 and trainer.beta == 0.04


@pytest.mark.slow
def test_vllm_ratio_on_kept_micro_batches_costs_one_transfer(tmp_path, tiny_model_path, dataset, monkeypatch):
    """Under vLLM's importance-sampling correction the ratio is formed per kept micro-batch on the device; its five
    logged metrics (TRL's, over the kept rows) are read back in one copy per generation batch. The forward is
    stubbed (a model on the emulated device is out of scope); TRL's flags are set as `use_vllm=True` sets them."""
    trainer = make_trainer(
        tiny_model_path, tmp_path, dataset=dataset, max_steps=1, steps_per_generation=2, gradient_accumulation_steps=2
    )
    batch, _, _ = _post_process(trainer, dataset, monkeypatch, 8)
    monkeypatch.setattr(trainer, "use_vllm", True, raising=False)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True, raising=False)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_truncate", raising=False)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_min", None, raising=False)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_clip_max", 3.0, raising=False)

    def forward(model, ids, mask, width, *a, **kw):
        return torch.full((ids.size(0), width), -1.0, device=ids.device), None, None

    monkeypatch.setattr(trainer, "_get_per_token_logps_and_entropies", forward)
    mode = FakeAccelerator()
    with mode:
        batch["sampling_per_token_logps"] = torch.full_like(batch["completion_mask"], -1.5, dtype=torch.float32)
        trainer._buffered_inputs = split_tensor_dict(batch, 2)
        trainer._process_new_buffer()
        chunks = trainer._buffered_inputs
        misplaced = [k for c in chunks for k, v in c.items() if isinstance(v, torch.Tensor) and v.device != FAKE]
    assert mode.transfers == 1, mode.transfers
    assert not misplaced, misplaced
    ratio = torch.exp(torch.tensor(0.5))  # exp(old − sampling) on every loss token
    assert trainer._metrics["train"]["sampling/importance_sampling_ratio/mean"][-1] == pytest.approx(float(ratio))
    assert trainer._metrics["train"]["sampling/sampling_logp_difference/max"][-1] == pytest.approx(0.5)
