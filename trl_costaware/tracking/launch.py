"""The duplicated launch: a launcher started several processes, but each one trains in a world of its own.

On a CPU machine, ``accelerate launch --multi_gpu --num_processes 2 script.py`` without ``--use_cpu true`` starts
two processes with ``WORLD_SIZE=2`` in their environment, and accelerate gives each of them a world of 1
(``DistributedType.NO``): two copies of the whole job run side by side, write one output dir (checkpoints, model,
the local record) and log every row twice. Nothing fails, and nothing says so. `duplicated_launch` names the case and
its fix; the trainer calls it once, at construction, and refuses the run (`CostAwareGRPOTrainer.__init__`).
"""

from __future__ import annotations

from collections.abc import Mapping


def duplicated_launch(environ: Mapping[str, str], num_processes: int, use_cpu: bool) -> str | None:
    """The refusal for a launch of ``WORLD_SIZE`` > 1 processes that each run in a world of 1, else None.

    ``environ``: the process environment (``os.environ``); ``num_processes``: the world this process trains in
    (accelerate's ``PartialState().num_processes``, ``TrainingArguments.world_size``); ``use_cpu``: the training
    arguments' ``use_cpu``, which on CPU is what makes accelerate join the launched processes in one gloo group.
    """
    try:
        launched = int(environ.get("WORLD_SIZE", "") or 1)
    except ValueError:
        return None
    if launched <= 1 or num_processes != 1:
        return None
    rank = environ.get("RANK")
    this = f"this process (rank {rank})" if rank is not None else "this process"
    head = (
        f"WORLD_SIZE={launched} in the environment: the launcher started {launched} processes, but {this} "
        f"trains in a world of 1. Each of the {launched} processes would train the whole job alone, write the same "
        f"output_dir and log every row {launched} times."
    )
    if use_cpu:
        fix = (
            " use_cpu is already set, so accelerate did not join the processes: check the launcher (its "
            "--num_processes and distributed settings), or unset WORLD_SIZE if this process is meant to run alone."
        )
    else:
        fix = (
            " On CPU, add --use_cpu true to the script's arguments (use_cpu=True in CostAwareGRPOConfig): accelerate "
            "then joins the processes in one gloo process group. Not ACCELERATE_USE_CPU=true in the environment, "
            "which drops a DeepSpeed config. Or launch one process, or unset WORLD_SIZE if this process is meant to "
            "run alone."
        )
    return head + fix
