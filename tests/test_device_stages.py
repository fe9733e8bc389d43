"""Device discipline of the opt-in stages without a GPU (tests/fake_device.py, with test_collectives.py's variant that
also refuses float64 on the device, as MPS does): the prompt stage (`cost_aware_prompt_sampling=True`: the index
column, the prompt weights, the history update) and the "compute" rule's gradient reads (`cost_aware/noise_scale`).

Each test runs the trainer's own code on tensors that live on the emulated accelerator and bounds the device→host
transfers per generation batch, counted as tests/test_device.py counts them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from fake_device import FAKE, is_marked, mark
from test_collectives import NoFloat64Device
from test_device import _post_process
from test_trainer import length_reward, make_args
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.prompts.stage import INDEX_COLUMN


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=0)


def _misplaced(batch) -> list[str]:
    return [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device != FAKE]


def _generation_on_device(trainer, monkeypatch, raw):
    """TRL's generation and scoring of `raw` (run once, on the host), replayed with every tensor it returns, and the
    rewards TRL gathers (`_calculate_rewards`, recorded by the prompt stage), on the emulated device."""
    trainer.model.train()
    inputs = [{k: v for k, v in x.items() if k != INDEX_COLUMN} for x in raw]
    full = GRPOTrainer._generate_and_score_completions(trainer, inputs)
    rewards = trainer._prompt_rewards
    assert rewards is not None and full["advantages"].abs().sum() > 0

    def on_device(self, given):
        assert all(INDEX_COLUMN not in x for x in given)  # the stage strips the column before TRL sees the inputs
        self._prompt_rewards = mark(rewards.clone())  # TRL's gathered rewards live on the device
        return {k: mark(v.clone()) if isinstance(v, torch.Tensor) else copy.copy(v) for k, v in full.items()}

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", on_device)
    return full


def _counting(monkeypatch, trainer, mode, name, transfers):
    """Wraps `trainer.<name>` to count the device→host transfers it makes into `transfers[name]`."""
    original = getattr(trainer, name)

    def counted(*args, **kwargs):
        before = mode.transfers
        out = original(*args, **kwargs)
        transfers[name] = transfers.get(name, 0) + mode.transfers - before
        return out

    monkeypatch.setattr(trainer, name, counted)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])  # dapo: the token normaliser's correction (loss tokens)
def test_prompt_stage_on_device(tmp_path, tiny_model_path, dataset, monkeypatch, loss_type):
    """The prompt stage's path on the emulated device: the loader's rows (drawn by `PromptSampler`, with the index
    column), the stage's one gather of the rows' index and token counts, the draw matched, the prompt weights applied
    to the device advantages, the update queued with host tensors and applied by the next draws. Transfers per
    generation batch: the stage's 2 (the rows' index and token counts; TRL's gathered rewards), the sampler's 1,
    nothing else after TRL."""
    args = make_args(tmp_path, max_steps=1, loss_type=loss_type, cost_aware_prompt_sampling=True)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    history = trainer._prompt_history
    raw = next(iter(trainer.get_train_dataloader()))  # the index column is in the loader's rows
    assert all(INDEX_COLUMN in x for x in raw) and history.records
    full = _generation_on_device(trainer, monkeypatch, raw)
    mode, transfers = NoFloat64Device(), {}
    _counting(monkeypatch, trainer, mode, "_weight_prompts", transfers)
    _counting(monkeypatch, trainer, mode, "_draw_kept_rows", transfers)
    with mode:
        batch = trainer._generate_and_score_completions(raw)
        misplaced = _misplaced(batch)
    assert not misplaced, f"moved off the batch's device: {misplaced}"
    assert transfers == {"_weight_prompts": 2, "_draw_kept_rows": 1}, transfers
    assert mode.transfers == 3, mode.transfers  # nothing else after TRL
    assert len(batch["advantages"]) < len(full["advantages"])  # the row sampler ran after the prompt weights
    metrics = trainer._metrics["train"]
    assert metrics["cost_aware/prompt_weight_max"] and metrics["cost_aware/prompt_token_normaliser"]
    # The history update: queued with host tensors, then applied when a later draw needs it (on the host).
    (draw, update), *_ = history.pending.items()
    assert history.taken == draw == 0
    queued = (update.rewards, update.completion_tokens, update.prompt_tokens)
    assert not any(is_marked(t) for t in queued), "the prompt history would hold device tensors"
    before = history.ea[update.indices] + history.eb[update.indices]
    with mode:
        history.apply_until(draw)
        value, zero, cost = history.predictions()  # what the next epoch's plan is drawn from
    assert history.applied == draw and bool(history.seen[update.indices].all())
    assert bool((history.ea[update.indices] + history.eb[update.indices] > before).all())  # the evidence is in
    assert not any(is_marked(t) for t in (history.ea, history.eb, history.completion, value, zero, cost))


@pytest.mark.slow
def test_zero_variance_share_on_device(tmp_path, tiny_model_path, dataset, monkeypatch):
    """Without the prompt stage, `cost_aware/zero_variance_token_share` reads TRL's gathered rewards and the rows'
    generated tokens: 2 transfers, no float64 on the device (the token counts were cast to float64 there before
    they were copied), then the sampler's 1."""
    args = make_args(tmp_path, max_steps=1)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    raw = [dataset[i] for i in range(8)]
    _generation_on_device(trainer, monkeypatch, raw)
    mode, transfers = NoFloat64Device(), {}
    _counting(monkeypatch, trainer, mode, "_log_zero_variance_share", transfers)
    _counting(monkeypatch, trainer, mode, "_draw_kept_rows", transfers)
    with mode:
        batch = trainer._generate_and_score_completions(raw)
        misplaced = _misplaced(batch)
    assert not misplaced, misplaced
    assert transfers == {"_log_zero_variance_share": 2, "_draw_kept_rows": 1}, transfers
    assert mode.transfers == 3
    assert 0.0 <= trainer._metrics["train"]["cost_aware/zero_variance_token_share"][-1] <= 1.0


@pytest.mark.slow
def test_noise_scale_reads_the_device_gradient(tmp_path, tiny_model_path, dataset, monkeypatch):
    """The "compute" rule's estimator on the emulated device: at each optimizer step `_clip_grad_norm` reads the
    device gradient (|G|², G·G' against the stored copy of an earlier generation batch's step), stores it on the
    device, and copies its three numbers to the host once; the next generation batch's plan uses the measured ρ.
    Transfers: 1 per optimizer step (the noise terms; the clipped flag waits for the log), 1 per generation batch
    (the sampler's), so 2 per generation batch here (one optimizer step each). The values are the host's."""
    args = make_args(tmp_path, max_steps=1, cost_aware_kept_fraction="compute", max_grad_norm=1.0)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.model.train()
    monkeypatch.setattr(GRPOTrainer, "_clip_grad_norm", lambda self, model: mark(torch.tensor(2.0)))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in params:  # the model lives on the device
        mark(p)
    generator = torch.Generator().manual_seed(0)
    signal = [torch.randn(p.shape, generator=generator) for p in params]
    host_grads = []
    mode = NoFloat64Device()
    trainer._step_rows = 16.0  # as `_note_plan` sets it (N · G / S rows behind a step)
    for step in range(3):
        trainer.state.global_step = step
        trainer._generation_index = step + 1  # one optimizer step per generation batch: every step pairs
        grads = [s + 0.5 * torch.randn(s.shape, generator=generator) for s in signal]
        host_grads.append(grads)
        with mode:
            for p, g in zip(params, grads, strict=True):
                p.grad = mark(g.clone())
            before = mode.transfers
            trainer._clip_grad_norm(trainer.model)
            assert mode.transfers - before == 1, mode.transfers - before
            assert all(is_marked(h) for h in trainer._previous_grad), "the stored gradient left the device"
    metrics = trainer._metrics["train"]
    squares = [float(sum((g.double() ** 2).sum() for g in grads)) for grads in host_grads]
    pairs = zip(host_grads[1:], host_grads[:-1], strict=True)
    dots = [float(sum((g.double() * h.double()).sum() for g, h in zip(a, b, strict=True))) for a, b in pairs]
    assert metrics["cost_aware/noise_grad_sq"] == pytest.approx(squares, rel=1e-4)
    assert metrics["cost_aware/noise_grad_dot"] == pytest.approx(dots, rel=1e-4)
    assert len(metrics["cost_aware/noise_scale"]) == 2 and trainer._noise.ratio is not None
    for p in params:  # the generation batch below runs on fresh rows
        p.grad = None
    batch, misplaced, transfers = _post_process(trainer, dataset, monkeypatch, 8)
    assert not misplaced, misplaced
    assert transfers == {"sampler": 1, "post_processing": 1}, transfers
    assert metrics["cost_aware/compute_rule_fallback"][-1] == 0.0  # the rule used the measured ρ


@pytest.mark.slow
@pytest.mark.parametrize("partition", ["some", "empty"])
def test_noise_scale_zero1_reads_on_device(tmp_path, tiny_model_path, dataset, monkeypatch, partition):
    """DeepSpeed ZeRO-1's read (`_observe_engine_gradient`: this rank's partition of the averaged gradient, summed
    over ranks by one all-reduce) on the emulated device, also for a rank whose partition is empty (its terms are 0
    on the engine's device). The all-reduce is emulated: it checks its tensor lives on the device and adds the other
    rank's terms. 1 transfer per optimizer step."""
    from trl_costaware.kept_count.step_signals import ZERO1

    args = make_args(tmp_path, max_steps=1, cost_aware_kept_fraction="compute")
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.model.train()
    trainer._gradient_source, trainer._noise_available, trainer._step_rows = ZERO1, True, 16.0
    other = torch.tensor([3.0, 2.0, 1.0])  # the other rank's |G|², G·G' and pairing flag
    reduced = []

    def all_reduce(terms, group=None):
        assert is_marked(terms), "the all-reduce was sent a host tensor"
        terms.add_(other.to(terms.device))
        reduced.append(terms.clone())

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    generator = torch.Generator().manual_seed(0)
    optimizer = type("ZeroOptimizer", (), {"dp_process_group": None, "averaged_gradients": {}})()
    engine = type("Engine", (), {"optimizer": optimizer, "device": FAKE, "fp16_enabled": lambda self: False})()
    mode = NoFloat64Device()
    squares = []
    for step in range(2):
        trainer.state.global_step, trainer._generation_index = step, step + 1
        grads = [torch.randn(5, generator=generator), torch.randn(3, 2, generator=generator)]
        with mode:
            optimizer.averaged_gradients = {0: [mark(g.clone()) for g in grads] if partition == "some" else []}
            before = mode.transfers
            trainer._observe_engine_gradient(engine)
            assert mode.transfers - before == 1
        own = float(sum((g.double() ** 2).sum() for g in grads)) if partition == "some" else 0.0
        squares.append(own + 3.0)
    assert len(reduced) == 2
    assert trainer._metrics["train"]["cost_aware/noise_grad_sq"] == pytest.approx(squares, rel=1e-5)
    assert len(trainer._metrics["train"]["cost_aware/noise_grad_dot"]) == 1  # the second step pairs with the first
