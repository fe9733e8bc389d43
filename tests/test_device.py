"""Device discipline without a GPU: the cost-aware post-processing run on a batch that lives on an (emulated)
accelerator must keep everything it returns there, and copy the sampler's inputs to the host once."""

from __future__ import annotations

import copy

import pytest
import torch
from fake_device import FAKE, FakeAccelerator, is_marked, mark
from test_trainer import length_reward, make_args
from trl import GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=0)


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
    """Run the trainer's batch post-processing on a real generation batch whose tensors live on the emulated device."""
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

    def counted(batch):  # device→host transfers made by the sampler (draw, weights, metrics)
        before = mode.transfers
        out = original(batch)
        transfers["sampler"] = mode.transfers - before
        return out

    monkeypatch.setattr(trainer, "_draw_kept_rows", counted)
    with mode:
        batch = trainer._generate_and_score_completions(raw)
        misplaced = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device != FAKE]
    return batch, misplaced, transfers


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"loss_type": "bnpo"},
        {"loss_type": "dapo", "beta": 0.04},
        {"cost_aware_token_budget": 60},
        {"cost_aware_draw": "multinomial", "cost_aware_weight_normalization": "self_normalize"},
        {"cost_aware_cost": "test_device:costs_on_host"},
    ],
    ids=["default", "bnpo", "dapo-kl", "token-budget", "multinomial-selfnorm", "host-cost-callable"],
)
def test_post_processing_keeps_the_batch_on_its_device(tmp_path, tiny_model_path, dataset, monkeypatch, overrides):
    trainer = CostAwareGRPOTrainer(
        tiny_model_path, [length_reward], args=make_args(tmp_path, max_steps=1, **overrides), train_dataset=dataset
    )
    batch, misplaced, transfers = _post_process(trainer, dataset, monkeypatch, 8)
    assert not misplaced, f"moved off the batch's device: {misplaced}"
    # One device→host copy of the sampler's inputs per generation batch (single process: no gather of m either).
    assert transfers["sampler"] == 1, transfers
    assert len(batch["advantages"]) < 8  # rows were dropped


def costs_on_host(prompt_mask, completion_mask):
    """A user cost callable that returns a host list (allowed): the trainer must move it to the batch's device. (It
    reads only shapes, so the transfers counted are the trainer's.)"""
    return [float(prompt_mask.shape[1] + i) for i in range(len(prompt_mask))]


@pytest.mark.slow
def test_deferred_log_prob_passes_on_device(tmp_path, tiny_model_path, dataset, monkeypatch):
    """With old-policy and reference passes deferred to the kept rows, the model runs on device inputs: the model's
    parameters are marked as device tensors, so a host tensor reaching the forward fails."""
    args = make_args(tmp_path, max_steps=1, steps_per_generation=2, gradient_accumulation_steps=1, beta=0.04)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    for module in (trainer.model, trainer.ref_model):
        for t in list(module.parameters()) + list(module.buffers()):
            mark(t)
    batch, misplaced, _ = _post_process(trainer, dataset, monkeypatch, 16)
    assert not misplaced, f"moved off the batch's device: {misplaced}"
    # The deferred passes run per micro-batch, when the trainer processes TRL's freshly split buffer.
    with FakeAccelerator():
        trainer._buffered_inputs = split_tensor_dict(batch, 2)
        trainer._process_new_buffer()
        chunks = list(trainer._processed_chunks.values())
        misplaced = [k for c in chunks for k, v in c.items() if isinstance(v, torch.Tensor) and v.device != FAKE]
    assert not misplaced, f"moved off the batch's device: {misplaced}"
    assert all(c["old_per_token_logps"] is not None and c["ref_per_token_logps"] is not None for c in chunks)
