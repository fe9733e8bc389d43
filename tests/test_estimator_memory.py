"""The noise-scale estimator's memory: its reads of the gradient (|G_t|², then G_t · G_t') make no float32 copy of a
whole parameter, only slices (`compute_budget.gradient_terms`).

Measured in a child process on the CPU (peak resident memory, `VmHWM`, reset before each call through
/proc/self/clear_refs): one parameter of the given shape and dtype with its gradient, and `_observe_gradient` called
twice, as at two optimizer steps of different generation batches. The first call reads |G|² and stores the copy G'
(one gradient's size in its own dtype: the estimator's state), the second reads |G|² and G · G'. Run as a script to
measure any shape, e.g. Qwen2.5-7B's embedding (152064 × 3584 in bfloat16; about 9 GiB of RAM before the change):

    MALLOC_MMAP_THRESHOLD_=1048576 python tests/test_estimator_memory.py --rows 152064 --cols 3584 --dtype bfloat16

and against another checkout of the package with `PYTHONPATH=/path/to/checkout` (`MALLOC` below says why the
environment variable).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

MiB = 1 << 20
# glibc serves blocks above a threshold that grows with the blocks freed (up to 32 MiB) from its heap, which keeps
# freed memory resident: a fixed 1 MiB threshold maps every large block on its own and returns it on free, so the
# resident peak measures what is alive (measured here: without it, the same call reads from +12 MiB to +200 MiB).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def _peak_since_reset() -> tuple[int, int]:
    """(peak, current) resident bytes of this process since the last `_reset_peak`."""
    values = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                values[key] = int(rest.split()[0]) * 1024
    return values["VmHWM"], values["VmRSS"]


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def measure(rows: int, cols: int, dtype: str, slice_size: int | None = None) -> dict:
    """Bytes above the resident memory before each of the estimator's two calls, at its peak during the call and
    after it (the stored copy), for one rows × cols parameter; in this process (call it in a fresh one)."""
    from trl_costaware.kept_count import compute_budget
    from trl_costaware.kept_count.compute_budget import NoiseScale
    from trl_costaware.kept_count.step_signals import ComputeSignals

    if slice_size is not None:
        compute_budget.GRADIENT_SLICE = slice_size
    torch.set_num_threads(1)
    weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=getattr(torch, dtype)))
    weight.grad = torch.empty_like(weight).normal_()
    model = torch.nn.Module()
    model.weight = weight

    class Host(ComputeSignals):
        pass

    host = Host()
    host.args = SimpleNamespace(cost_aware=True, cost_aware_kept_fraction="compute", cost_aware_budget_delta=0.1)
    host.is_deepspeed_enabled = host.is_fsdp_enabled = False
    host.accelerator = SimpleNamespace(scaler=None)
    host.add_callback = lambda callback: None
    host._metrics = {"train": defaultdict(list)}
    host.state = SimpleNamespace(global_step=0)
    host.model = model
    host._init_compute_signals()
    host._noise = NoiseScale(0.9)
    calls = []
    for step in range(2):
        host.state.global_step, host._generation_index = step, step
        before = _peak_since_reset()[1]
        _reset_peak()
        host._observe_gradient(model)
        peak, after = _peak_since_reset()
        calls.append({"peak": peak - before, "after": after - before})
    assert "cost_aware/noise_grad_dot" in host._metrics["train"]  # the second call read the dot product
    return {
        "shape": [rows, cols],
        "dtype": dtype,
        "gradient_bytes": weight.grad.numel() * weight.grad.element_size(),
        "float32_copy_bytes": weight.grad.numel() * 4,
        "slice": compute_budget.__dict__.get("GRADIENT_SLICE"),
        "first_call": calls[0],
        "second_call": calls[1],
    }


def measure_in_child(rows: int, cols: int, dtype: str, slice_size: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--rows", str(rows), "--cols", str(cols), "--dtype", dtype, "--json"]
    if slice_size is not None:
        cmd += ["--slice", str(slice_size)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **MALLOC}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_estimator_makes_no_float32_copy_of_a_parameter():
    """A 4096 × 8192 bfloat16 gradient (64 MiB; 128 MiB as float32) read in slices of 2^20 elements: each call's peak
    stays well under one float32 copy of the parameter (before: about 2 copies for |G|², 3 for the dot product); the
    first call keeps the stored copy (one gradient in bfloat16), the second stores nothing new."""
    result = measure_in_child(4096, 8192, "bfloat16", slice_size=1 << 20)
    grad, copy32 = result["gradient_bytes"], result["float32_copy_bytes"]
    first, second = result["first_call"], result["second_call"]
    assert second["peak"] < copy32 / 4, result
    assert first["peak"] < grad + copy32 / 4, result
    assert abs(first["after"] - grad) < grad / 4 and abs(second["after"]) < grad / 4, result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=152064)
    p.add_argument("--cols", type=int, default=3584)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--slice", type=int, default=None, help="compute_budget.GRADIENT_SLICE for this run")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = p.parse_args(argv)
    result = measure(args.rows, args.cols, args.dtype, args.slice)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"parameter {args.rows} x {args.cols} {args.dtype}: gradient {result['gradient_bytes'] / MiB:.0f} MiB")
    for name in ("first_call", "second_call"):
        call = result[name]
        print(f"  {name}: peak +{call['peak'] / MiB:.0f} MiB, after +{call['after'] / MiB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
