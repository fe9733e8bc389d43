"""Worker for tests/test_prompt_distributed.py: Cost-Aware GRPO with the prompt stage on 2 CPU processes (gloo).

Each rank writes rank{r}.json: every draw the prompt sampler made (prompts in order, weights), the history's arrays
and counters at the end, and the advantage factors this rank applied per generation batch. The parent checks that
both ranks made the same decisions."""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

NUM_GENERATIONS = 4


def reward(completions, answer, **kwargs) -> list[float]:
    """Half the problems (odd answers) get a constant reward (zero-variance groups, "solved"); the others vary."""
    return [
        1.0 if int(a) % 2 else float(i % NUM_GENERATIONS) + 0.1 * len(str(c))
        for i, (c, a) in enumerate(zip(completions, answer, strict=True))
    ]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--steps-per-generation", type=int, default=None)  # None: TRL's default (= accumulation steps)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    args = p.parse_args()

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded.arithmetic import arithmetic_dataset

    config = CostAwareGRPOConfig(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=args.rows,
        gradient_accumulation_steps=args.accumulation,
        steps_per_generation=args.steps_per_generation,
        num_generations=NUM_GENERATIONS,
        max_completion_length=8,
        max_steps=args.max_steps,
        learning_rate=1e-3,
        seed=0,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        cost_aware_kept_fraction=0.5,
        cost_aware_prompt_sampling=True,
        cost_aware_prompt_smoothing=0.2,
    )
    trainer = CostAwareGRPOTrainer(args.model, [reward], args=config, train_dataset=arithmetic_dataset(16, seed=5))
    factors = []
    original = trainer._weight_prompts

    def weight_and_record(batch, local):
        before = batch["advantages"].clone()
        original(batch, local)
        ratio = torch.where(before != 0, batch["advantages"] / before, torch.zeros_like(before))
        factors.append(ratio.tolist())

    trainer._weight_prompts = weight_and_record
    trainer.train()
    h = trainer._prompt_history
    record = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "draws": {str(t): {"indices": r.indices, "weights": r.weights.tolist()} for t, r in h.records.items()},
        "applied": h.applied,
        "taken": h.taken,
        "a": h.a.tolist(),
        "b": h.b.tolist(),
        "factors": factors,
        "steps": trainer.state.global_step,
        "lag": h.lag,
    }
    with open(os.path.join(args.out, f"rank{record['rank']}.json"), "w") as fh:
        json.dump(record, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
