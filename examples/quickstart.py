"""usage: accelerate launch examples/quickstart.py

TRL's GRPO quick start (docs/source/grpo_trainer.md) with the one-line swap to CostAwareGRPOTrainer: trains
Qwen/Qwen2-0.5B-Instruct on trl-lib/DeepMath-103K with TRL's accuracy_reward (pip install math-verify), both
downloaded from the Hugging Face Hub. It takes no arguments; for a configurable script see
examples/train_cost_aware_grpo.py (trl-costaware train --help).
"""

# ruff: noqa: E402 (TRL's script below keeps its imports where TRL has them)
import sys

if {"-h", "--help"} & set(sys.argv[1:]):  # not in TRL's script: --help answers offline, before any download
    print(__doc__.strip())
    sys.exit(0)

# train_grpo.py
from datasets import load_dataset
from trl_costaware import CostAwareGRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = CostAwareGRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
