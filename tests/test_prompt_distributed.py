"""The prompt stage on two CPU processes (torchrun, gloo): both ranks make the same prompt decisions, and no hang."""

from __future__ import annotations

import json
import sys

import pytest
from test_distributed import LAUNCH_TIMEOUT, ROOT, free_port, run

WORKER = ROOT / "tests" / "dist_workers" / "prompt_worker.py"


@pytest.mark.multiprocess
def test_both_ranks_make_the_same_prompt_decisions(tiny_model_path, tmp_path):
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
    ]
    run(cmd, tmp_path / "log.txt", timeout=LAUNCH_TIMEOUT)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2 and r0["steps"] == r1["steps"] == 6
    assert r0["draws"] == r1["draws"]  # the same prompts, in the same order, with the same weights
    assert (r0["applied"], r0["taken"], r0["a"], r0["b"]) == (r1["applied"], r1["taken"], r1["a"], r1["b"])
    assert r0["taken"] == 5 and r0["applied"] >= 3  # every batch matched its draw; the history was updated
    weights = [w for d in r0["draws"].values() for w in d["weights"]]
    assert max(weights) > 1.01 and min(weights) < 0.99  # the history moved the draw away from uniform
    # each rank weighted its own half of every batch by its prompts' weights
    assert len(r0["factors"]) == len(r1["factors"]) == 6
