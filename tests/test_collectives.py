"""The cross-rank collectives send no float64 to the device (not every device has it: MPS has none), and their
results stay float64-exact: `plan.AcceleratorCollective` (the plan's three calls, the trainer's counters) and the
vLLM ratio log (`CostAwareGRPOTrainer._log_vllm_ratio`, whose metrics are TRL's over ranks). The device is emulated
(tests/fake_device.py) and refuses float64."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch
from fake_device import FakeAccelerator, is_marked
from test_plan import make_rows
from torch.utils._pytree import tree_flatten

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.rows.deferred import VLLM_METRICS
from trl_costaware.rows.plan import (
    AcceleratorCollective,
    PlanSettings,
    SingleProcess,
    float64_bits,
    plan_batch,
    to_float64,
)


class NoFloat64Device(FakeAccelerator):
    """The emulated accelerator, refusing any float64 tensor on the device (as MPS does)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if is_marked(t) and t.dtype == torch.float64:
                raise TypeError(f"float64 on the device (in {getattr(func, '__qualname__', func)})")
        return out


class Ranks:
    """An accelerator of 2 processes seen from rank 0: `gather` refuses float64, checks the tensor is on the device,
    records what it was sent and appends the other rank's tensor (`other(x)`; by default a copy of `x`)."""

    process_index, num_processes = 0, 2

    def __init__(self, other=None):
        self.other = other or (lambda x: x.clone())
        self.sent = []

    def gather(self, x):
        assert x.dtype != torch.float64, "float64 sent to the collective"
        assert is_marked(x), "gathered from the host, not the device"
        self.sent.append(x.clone())
        return torch.cat([x, self.other(x)])


def _chunk(old, sampling, mask, ratio):
    return {
        "old_per_token_logps": torch.tensor(old),
        "sampling_per_token_logps": torch.tensor(sampling),
        "completion_mask": torch.tensor(mask),
        "importance_sampling_ratio": torch.tensor(ratio),
    }


def _host(accelerator, mode="token_truncate"):
    """What `CostAwareGRPOTrainer._log_vllm_ratio` reads of its trainer, around the given accelerator."""
    host = types.SimpleNamespace(
        accelerator=accelerator,
        vllm_importance_sampling_mode=mode,
        _metrics={"train": defaultdict(list)},
        _loss_mask=lambda chunk: chunk["completion_mask"],
    )
    host._log_vllm_ratio = types.MethodType(CostAwareGRPOTrainer._log_vllm_ratio, host)
    return host


def _trl_values(ranks):
    """TRL's own reductions (GRPOTrainer._generate_and_score_completions), rank by rank, then over ranks."""
    means, maxes, r_mins, r_means, r_maxes = [], [], [], [], []
    for chunks in ranks:
        delta = torch.cat([(c["old_per_token_logps"] - c["sampling_per_token_logps"]).abs().flatten() for c in chunks])
        mask = torch.cat([c["completion_mask"].bool().flatten() for c in chunks])
        ratio = torch.cat([c["importance_sampling_ratio"].flatten() for c in chunks])
        d = delta[mask & ~torch.isnan(delta)]
        means.append(d.mean() if d.numel() else torch.tensor(0.0))
        maxes.append(d.max() if d.numel() else torch.tensor(0.0))
        r = ratio[mask]
        r_mins.append(r.min() if r.numel() else torch.tensor(0.0))
        r_means.append(r.mean() if r.numel() else torch.tensor(0.0))
        r_maxes.append(r.max() if r.numel() else torch.tensor(0.0))
    return [
        float(torch.stack(means).mean()),
        float(torch.stack(maxes).max()),
        float(torch.stack(r_mins).min()),
        float(torch.stack(r_means).mean()),
        float(torch.stack(r_maxes).max()),
    ]


def test_float64_bits_round_trip_exactly():
    x = torch.tensor([1.0 + 2**-52, 1e300, -1e-300, math.inf, 1 / 3, 2.0**53 + 2], dtype=torch.float64)
    bits = float64_bits(x)
    assert bits.dtype == torch.int64
    assert torch.equal(to_float64(bits), x)


def test_weights_gather_is_float64_bit_for_bit():
    """`AcceleratorCollective.cat` carries the float64 weights exactly (a float32 round trip would move them)."""

    class Mirror:
        process_index, num_processes = 0, 2

        def gather(self, x):
            return torch.cat([x, x])

    x = torch.tensor([[1.0 + 1e-12, 0.0], [1.0 / 3.0, 1.0], [1e-300, 0.0]], dtype=torch.float64)
    out = AcceleratorCollective(Mirror(), torch.device("cpu")).cat(x)
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.cat([x, x]))


def test_sum_sends_no_float64_and_is_exact():
    """Counters past 2^53 / 2^24: float32 would move them; the int64 bit pattern carries them exactly."""
    values = {"tokens": 2.0**53, "rows": 3.0, "fraction": 0.1}
    other = {"tokens": 2.0, "rows": 16777217.0, "fraction": 0.2}
    ranks = Ranks(lambda x: float64_bits(torch.tensor([list(other.values())], dtype=torch.float64)).to(x.device))
    with NoFloat64Device():
        total = AcceleratorCollective(ranks, torch.device("cuda", 0)).sum(values)
    assert total == {k: values[k] + other[k] for k in values}
    assert total["tokens"] == 2.0**53 + 2.0 and total["rows"] == 16777220.0
    assert [t.dtype for t in ranks.sent] == [torch.int64]


def test_plan_sends_no_float64():
    """The plan's three calls (the kept count, the weights, the sums) on an emulated device that has no float64; two
    identical ranks give the one-process plan's totals twice, exactly."""
    rows = make_rows([1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 0.25], loss_tokens=[3, 5, 8, 13, 21, 34, 55, 89])
    settings = PlanSettings(kept_fraction=0.5)
    one = plan_batch(rows, settings, torch.Generator().manual_seed(0), SingleProcess())
    ranks = Ranks()
    with NoFloat64Device():
        two = plan_batch(rows, settings, torch.Generator().manual_seed(0), AcceleratorCollective(ranks, "cuda"))
    assert len(ranks.sent) == 3 and all(t.dtype != torch.float64 for t in ranks.sent)
    assert two.totals == {k: 2 * v for k, v in one.totals.items()}
    assert torch.equal(two.indices, one.indices)


def _two_rank_log(rank0, rank1, local0, local1):
    """Rank 0's `_log_vllm_ratio` on the float64-free device, the other rank's wire being what rank 1's own call
    sends."""
    device = torch.device("cuda", 0)
    wire = []

    class Capture(Ranks):
        def gather(self, x):
            wire.append(x.clone())
            return super().gather(x)

    with NoFloat64Device() as mode:
        chunks1 = mode.to_device([dict(c) for c in rank1])
        _host(Capture())._log_vllm_ratio(chunks1, dict(local1), device)
        ranks = Ranks(lambda x: wire[0])
        host = _host(ranks)
        host.summed = host._log_vllm_ratio(mode.to_device([dict(c) for c in rank0]), dict(local0), device)
    assert len(ranks.sent) == 1 and ranks.sent[0].dtype == torch.int64
    return host


@pytest.mark.parametrize("empty_rank", [False, True])
def test_vllm_ratio_log_sends_no_float64(empty_rank):
    """The vLLM metrics as TRL defines them over ranks (rank 0 many tokens with small differences, rank 1 few with
    large ones, or none: TRL averages per-rank means, and a rank without a token counts 0), and the counters summed
    exactly, with no float64 on the device (before: the statistics were cast to float64 on the device, and gathered
    so)."""
    rank0 = [
        _chunk([[-1.0, -1.0, -1.0, -1.0]] * 2, [[-1.1, -1.1, -1.1, -1.1]] * 2, [[1, 1, 1, 1]] * 2, [[1.1] * 4] * 2),
        _chunk([[-1.0, -1.0, -1.0, -1.0]], [[-1.2, math.nan, -1.2, -1.2]], [[1, 1, 1, 0]], [[1.2, 1.0, 1.2, 1.0]]),
    ]
    rank1 = [_chunk([[-1.0, -1.0]], [[-2.0, -2.0]], [[0, 0] if empty_rank else [1, 0]], [[2.5, 1.0]])]
    host = _two_rank_log(rank0, rank1, {"policy_tokens_padded": 2.0**53}, {"policy_tokens_padded": 2.0})
    logged = [host._metrics["train"][k][-1] for k in VLLM_METRICS]
    assert logged == pytest.approx(_trl_values([rank0, rank1]), rel=1e-6)
    assert host.summed == {"policy_tokens_padded": 2.0**53 + 2.0}


def test_vllm_ratio_log_one_process_no_float64():
    """One process: no gather, and still no float64 on the device; one device→host copy."""
    chunks = [_chunk([[-1.0, -1.5]], [[-1.25, -1.0]], [[1, 1]], [[0.9, 1.3]])]
    host = _host(type("One", (), {"process_index": 0, "num_processes": 1})())
    with NoFloat64Device() as mode:
        summed = host._log_vllm_ratio(mode.to_device([dict(c) for c in chunks]), {"policy_tokens": 7.0}, "cuda")
    assert mode.transfers == 1 and summed == {"policy_tokens": 7.0}
    assert [host._metrics["train"][k][-1] for k in VLLM_METRICS] == pytest.approx(_trl_values([chunks]), rel=1e-6)
