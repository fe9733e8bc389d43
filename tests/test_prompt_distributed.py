"""The prompt stage on two CPU processes (torchrun, gloo): both ranks make the same prompt decisions, and no hang,
whatever the generation batches per optimizer step (steps_per_generation below, at and above the accumulation
steps: the lag is counted in generation batches per optimizer step, issue 38)."""

from __future__ import annotations

import json
import sys

import pytest
from test_distributed import LAUNCH_TIMEOUT, ROOT, free_port, run

WORKER = ROOT / "tests" / "dist_workers" / "prompt_worker.py"

# (steps_per_generation, gradient_accumulation_steps, per-device rows, optimizer steps, generation batches)
CASES = {
    "spg-default": (None, 2, 4, 6, 6),
    "spg1-ga2": (1, 2, 4, 6, 12),
    "spg4-ga2": (4, 2, 2, 12, 6),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_both_ranks_make_the_same_prompt_decisions(tiny_model_path, tmp_path, case):
    spg, ga, rows, steps, batches = CASES[case]
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
        str(tmp_path),
        "--max-steps",
        str(steps),
        "--accumulation",
        str(ga),
        "--rows",
        str(rows),
    ]
    if spg is not None:
        cmd += ["--steps-per-generation", str(spg)]
    run(cmd, tmp_path / "log.txt", timeout=LAUNCH_TIMEOUT)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2 and r0["steps"] == r1["steps"] == steps
    assert r0["draws"] == r1["draws"]  # the same prompts, in the same order, with the same weights
    assert (r0["applied"], r0["taken"], r0["a"], r0["b"]) == (r1["applied"], r1["taken"], r1["a"], r1["b"])
    assert r0["taken"] == batches - 1 and r0["applied"] >= 0  # every batch matched its draw; the history was updated
    weights = [w for d in r0["draws"].values() for w in d["weights"]]
    assert max(weights) > 1.01 and min(weights) < 0.99  # the history moved the draw away from uniform
    # each rank weighted its own half of every batch by its prompts' weights
    assert len(r0["factors"]) == len(r1["factors"]) == batches
