"""The built-in tasks by name: dataset, reward, the warm-up's SFT completions and the evaluation's length cap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .arithmetic import arithmetic_dataset, arithmetic_reward, max_completion_tokens
from .counting import LONG_MAX_COMPLETION_LENGTH, counting_dataset, counting_reward


@dataclass(frozen=True)
class Task:
    """`dataset(n, seed=...)` gives rows with ``prompt``, ``answer`` and ``solution``; `reward` is a TRL reward
    function; `max_new_tokens` is the length cap of training and evaluation."""

    name: str
    dataset: Callable
    reward: Callable
    max_new_tokens: int


TASKS = {
    "arithmetic": Task("arithmetic", arithmetic_dataset, arithmetic_reward, max_completion_tokens()),
    "counting": Task("counting", counting_dataset, counting_reward, LONG_MAX_COMPLETION_LENGTH),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]
