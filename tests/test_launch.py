"""The duplicated launch: a launcher started N processes (``WORLD_SIZE=N``) but each runs in a world of 1.

On CPU, ``accelerate launch --multi_gpu --num_processes 2`` without ``--use_cpu true`` starts two processes that each
train the whole job alone: they write one output dir and log every row twice. The trainer refuses it at
construction (`trl_costaware.tracking.launch`), before the model loads, with the fix in the message.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_costaware.tracking.launch import duplicated_launch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_cost_aware_grpo.py"


# ---------------------------------------------------------------------------------------------------- the check
@pytest.mark.parametrize("world", ["2", "8"])
def test_a_world_of_one_under_a_multi_process_launch_is_named_with_the_fix(world):
    message = duplicated_launch({"WORLD_SIZE": world, "RANK": "1"}, num_processes=1, use_cpu=False)
    assert message is not None
    assert f"WORLD_SIZE={world}" in message and "world of 1" in message
    assert "--use_cpu true" in message and "use_cpu=True" in message
    assert "rank 1" in message


@pytest.mark.parametrize(
    "environ, num_processes",
    [
        ({}, 1),  # a plain single-process run
        ({"WORLD_SIZE": "1"}, 1),  # accelerate launch --num_processes 1
        ({"WORLD_SIZE": "2"}, 2),  # a real two-process run
        ({"WORLD_SIZE": "4"}, 4),
        ({"WORLD_SIZE": ""}, 1),
        ({"WORLD_SIZE": "not a number"}, 1),
    ],
)
def test_consistent_launches_pass(environ, num_processes):
    assert duplicated_launch(environ, num_processes=num_processes, use_cpu=False) is None


def test_with_use_cpu_already_set_the_message_does_not_repeat_it():
    message = duplicated_launch({"WORLD_SIZE": "2"}, num_processes=1, use_cpu=True)
    assert message is not None and "--use_cpu true" not in message
    assert "WORLD_SIZE" in message  # names the variable to unset for a process meant to run alone


def test_the_trainer_refuses_at_construction(monkeypatch, tmp_path, tiny_model_path):
    """The check runs in the trainer's construction: WORLD_SIZE=2 in the environment and a world of 1 (the training
    arguments were built in this one process) is refused before the model loads."""
    from transformers import AutoModelForCausalLM

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded.arithmetic import arithmetic_dataset, arithmetic_reward

    args = CostAwareGRPOConfig(
        output_dir=str(tmp_path), report_to="none", bf16=False, per_device_train_batch_size=8, num_generations=4
    )
    assert args.world_size == 1

    def loaded(*a, **k):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", loaded)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*world of 1.*--use_cpu true"):
        CostAwareGRPOTrainer(tiny_model_path, [arithmetic_reward], args=args, train_dataset=arithmetic_dataset(8))
    assert not (tmp_path / "cost_aware_metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------------- for real
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine --multi_gpu starts a real two-process run")
def test_duplicated_cpu_launch_is_refused(tmp_path, warm_model_path):
    """``accelerate launch --multi_gpu --num_processes 2`` of the example script on CPU, without --use_cpu: both
    processes stop at construction with the fix, and nothing is written to the output dir. (The same launch with
    ``--use_cpu true`` trains one world of 2: tests/test_distributed.py's example tests.) Before the refusal the two
    processes trained side by side; 40 short steps (seconds) let their logging overlap in the one record."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
        str(EXAMPLE),
        "--model_name_or_path", warm_model_path,
        "--output_dir", str(out),
        "--max_steps", "40", "--per_device_train_batch_size", "8", "--num_generations", "4",
        "--max_completion_length", "8", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
        "--bf16", "false", "--report_to", "none", "--disable_tqdm", "true",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline")
    env.pop("ACCELERATE_USE_CPU", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    record = out / "cost_aware_metrics.jsonl"
    if proc.returncode == 0:
        rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
        steps = [r["step"] for r in rows if r.get("split") == "train"]
        pytest.fail(f"the duplicated launch trained: rc 0, train rows at steps {steps} in one record")
    assert log.count("--use_cpu true") >= 2, log[-4000:]  # each rank says it
    assert "world of 1" in log and "WORLD_SIZE=2" in log
    assert not record.exists()
