"""TRL's vLLM importance-sampling metrics on two CPU processes (torchrun, gloo) when one rank has no real micro-batch.

`_log_vllm_ratio` gathers every rank's ratio statistics once per generation batch. A rank whose micro-step positions
are all no-ops has no statistic of its own: it must still join that gather (else the other rank waits forever) and
count as a rank without a token, as TRL counts one (`vllm_ratio.vllm_metrics`). The worker runs TRL's vLLM colocate
path with test_vllm.py's stand-in engine (`tests/dist_workers/vllm_empty_rank_worker.py`).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from test_collectives import _chunk, _trl_values, _two_rank_log
from test_distributed import ROOT, free_port, run

from trl_costaware.rows.deferred import VLLM_METRICS

WORKER = ROOT / "tests" / "dist_workers" / "vllm_empty_rank_worker.py"
TIMEOUT = 240  # seconds: a rank left out of the gather shows up as a timeout (or the other rank's error)


def trl_reduction(per_rank: list[dict]) -> dict[str, float]:
    """TRL's reduction over ranks (`GRPOTrainer._generate_and_score_completions`): means of the per-rank means,
    extremes of the per-rank extremes, a rank without a token counting 0."""
    n = len(per_rank)
    return {
        "sampling/sampling_logp_difference/mean": sum(r["delta_mean"] for r in per_rank) / n,
        "sampling/sampling_logp_difference/max": max(r["delta_max"] for r in per_rank),
        "sampling/importance_sampling_ratio/min": min(r["ratio_min"] for r in per_rank),
        "sampling/importance_sampling_ratio/mean": sum(r["ratio_mean"] for r in per_rank) / n,
        "sampling/importance_sampling_ratio/max": max(r["ratio_max"] for r in per_rank),
    }


MODES = ("token_truncate", "sequence_mask")


@pytest.mark.multiprocess
def test_vllm_ratio_metrics_with_a_rank_without_real_micro_batch(tiny_model_path, tmp_path):
    """Rank 1 without a real micro-batch (every position a no-op): no error, no hang, both ranks log the same five
    `sampling/*` metrics, equal to TRL's reduction of rank 0's statistics with rank 1 counting as a rank without a
    token; the buffer's counters are the same on both ranks. The control case (both ranks real) is reduced alike."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(WORKER),
        "--model",
        str(tiny_model_path),
        "--out",
        str(out),
        "--modes",
        ",".join(MODES),
    ]
    run(cmd, tmp_path / "log.txt", timeout=TIMEOUT)
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2
    for mode in MODES:
        empty, both = (r0[mode]["empty"], r1[mode]["empty"]), (r0[mode]["both"], r1[mode]["both"])
        assert empty[1]["stats"]["real"] == 0 and empty[1]["positions"] == 2  # the case meant: no real micro-batch
        assert empty[0]["stats"]["real"] >= 1 and empty[0]["stats"]["tokens"] > 0
        assert all(b["stats"]["real"] >= 1 for b in both)
        for ranks in (empty, both):
            assert ranks[0]["metrics"] == ranks[1]["metrics"]  # one value each, the same on both ranks
            assert ranks[0]["totals"] == ranks[1]["totals"]
            expected = trl_reduction([r["stats"] for r in ranks])
            for key, value in expected.items():
                logged = ranks[0]["metrics"][key]
                assert len(logged) == 1, (mode, key, logged)
                assert logged[0] == pytest.approx(value, rel=1e-5, abs=1e-6), (mode, key)
        # rank 1 counts 0: the means are half of rank 0's own, the minimum ratio 0 (TRL's rule for a rank without
        # a token)
        metrics = empty[0]["metrics"]
        assert metrics["sampling/importance_sampling_ratio/mean"][0] == pytest.approx(
            empty[0]["stats"]["ratio_mean"] / 2, rel=1e-5
        )
        assert metrics["sampling/importance_sampling_ratio/min"] == [0.0]
        if mode.endswith("truncate"):  # (a masked ratio is 0 anyway)
            assert both[0]["metrics"]["sampling/importance_sampling_ratio/min"][0] >= 0.8  # clip_min: no rank at 0


@pytest.mark.parametrize("empty", [0, 1], ids=["logging-rank-empty", "other-rank-empty"])
def test_vllm_ratio_log_of_a_rank_without_micro_batch_on_device(empty):
    """In process, on the emulated float64-free device (test_collectives.py's harness: rank 0's call, the other rank's
    wire from its own call): a rank without a micro-batch sends one int64 wire as the other does, and counts as a
    rank whose micro-batches have no loss token; the counters are summed exactly. Before the fix: `torch.stack([])`
    (RuntimeError: stack expects a non-empty TensorList) on the empty rank."""
    real = [
        _chunk([[-1.0, -1.0, -1.0]] * 2, [[-1.1, -1.3, math.nan]] * 2, [[1, 1, 1]] * 2, [[1.1, 1.2, 1.0]] * 2),
        _chunk([[-1.0, -1.0]], [[-0.5, -2.0]], [[1, 0]], [[0.6, 1.0]]),
    ]
    no_token = [_chunk([[-1.0]], [[-3.0]], [[0]], [[9.0]])]  # what a rank without a token reports
    ranks = [real, []] if empty == 1 else [[], real]
    host = _two_rank_log(ranks[0], ranks[1], {"policy_tokens_padded": 2.0**53}, {"policy_tokens_padded": 3.0})
    logged = [host._metrics["train"][k][-1] for k in VLLM_METRICS]
    expected = _trl_values([real, no_token] if empty == 1 else [no_token, real])
    assert logged == pytest.approx(expected, rel=1e-6)
    assert expected[2] == 0.0 and expected[3] > 0  # the empty rank counts 0, as TRL counts a rank without a token
    assert host.summed == {"policy_tokens_padded": 2.0**53 + 3.0}
