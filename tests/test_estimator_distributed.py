"""The "compute" rule's noise scale under DeepSpeed ZeRO-0 and ZeRO-1 (two CPU processes over gloo, the worker of
tests/test_distributed.py): accelerate runs the engine's step inside `backward`, so the estimator reads the gradient
there (ZeRO-0: the all-reduced `param.grad`; ZeRO-1: each rank's partition of the averaged gradient, summed over
ranks). Both read what DDP reads: the same |G_t|², G_t · G_t' and noise-to-signal ratio at every step, on both ranks,
and the rule runs on it (no fallback once it has an estimate)."""

from __future__ import annotations

import math
import sys

import pytest
from test_distributed import (
    DEEPSPEED,
    WORKER,
    cost_aware_logs,
    deepspeed_json,
    free_port,
    load_result,
    run_once,
    session_shared_dir,
)

NOISE_KEYS = ("cost_aware/noise_grad_sq", "cost_aware/noise_grad_dot", "cost_aware/noise_to_signal")


def _launch(root, name, tiny_model_path, extra=()):
    out = root / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), str(WORKER), "--model", tiny_model_path, "--out", str(out)]
    cmd += ["--kept-fraction", "compute", "--cost-model", "tokens", "--max-steps", "4", "--weight-normalization"]
    # the noise probe off: this file compares the consecutive steps' estimator across backends (DeepSpeed turns the
    # probe off; under DDP it would set ρ from the third batch on and change m: tests/test_noise_probe.py)
    cmd += ["none", "--noise-probe-every", "0", *extra]
    return load_result(run_once(root, name, cmd))["records"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [pytest.param(0, marks=DEEPSPEED), pytest.param(1, marks=DEEPSPEED)])
def test_noise_scale_under_zero_0_and_1_reads_what_ddp_reads(tiny_model_path, tmp_path_factory, stage):
    root = session_shared_dir(tmp_path_factory, "estimator_runs")
    ddp = _launch(root, "ddp", tiny_model_path)
    zero = _launch(root, f"zero{stage}", tiny_model_path, ["--deepspeed", deepspeed_json(root, stage)])
    assert [r["zero_stage"] for r in zero] == [stage, stage]
    logs0, logs1 = cost_aware_logs(zero[0]), cost_aware_logs(zero[1])
    reference = cost_aware_logs(ddp[0])
    assert len(logs0) == len(reference) == 4
    for key in NOISE_KEYS:  # both ranks alike (ZeRO-1: the partitions' sums are all-reduced)
        assert [h.get(key) for h in logs0] == [h.get(key) for h in logs1]
    assert "cost_aware/noise_grad_dot" not in logs0[0]
    for h, d in zip(logs0, reference, strict=True):
        assert math.isfinite(h["cost_aware/noise_grad_sq"])
        for key in NOISE_KEYS:
            assert (key in h) == (key in d)
            if key in d:
                assert h[key] == pytest.approx(d[key], rel=1e-4), key
    assert logs0[0]["cost_aware/compute_rule_fallback"] == 1.0  # no estimate before the second step
    assert all(h["cost_aware/compute_rule_fallback"] == 0.0 for h in logs0[2:])
    assert [r["kept"] for r in zero] == [r["kept"] for r in ddp]
