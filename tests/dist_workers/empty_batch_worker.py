"""Worker for tests/test_distributed.py::test_empty_batches_train_on: several short Cost-Aware GRPO runs in one launch,
each with ranks that have no loss token at all.

Launched with `torchrun --nproc_per_node 2` (two CPU processes, gloo). `--cases` lists runs as LOSS:BETA:EMPTY, EMPTY
being `rank1` (rank 1's completions are all truncated and hidden by `mask_truncated_completions`; rank 0's are not) or
`all` (every rank's). A rank is made empty by forbidding EOS and padding in its generation: every completion then runs
to `max_completion_length` and the truncation mask hides it; a rank that is not empty forces EOS at the cap, so that
every completion there ends and carries loss tokens. Each rank writes --out/rank{r}.json: per case, its log
history, this rank's loss tokens per generation batch (the plan's input), the KL scale the plan gave it, a checksum
of its final weights and how far they moved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)

NUM_GENERATIONS = 4


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def varied_reward(completions, **kwargs) -> list[float]:
    return [float(i % NUM_GENERATIONS) + 0.1 * sum(ch.isdigit() for ch in str(c)) for i, c in enumerate(completions)]


def flat_weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double().cpu() for p in model.parameters()])


def run_case(spec: str, model_path: str, out: str):
    from transformers import AutoTokenizer

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware import trainer as trainer_module
    from trl_costaware.embedded.arithmetic import arithmetic_dataset

    loss_type, beta, empty = spec.split(":")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    empty_here = empty == "all" or (empty == "rank1" and _rank() == 1)
    if empty_here:  # neither EOS nor padding: every completion is cut at the cap, and the truncation mask hides it
        generation_kwargs = {"suppress_tokens": sorted({tokenizer.eos_token_id, tokenizer.pad_token_id})}
    else:  # EOS as the last token at the latest: every completion ends, and the loss sees it
        generation_kwargs = {"forced_eos_token_id": tokenizer.eos_token_id}
    config = CostAwareGRPOConfig(
        output_dir=os.path.join(out, "trainer", spec.replace(":", "_")),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=NUM_GENERATIONS,
        max_completion_length=4,
        mask_truncated_completions=True,
        generation_kwargs=generation_kwargs,
        max_steps=1,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        loss_type=loss_type,
        importance_sampling_level="sequence" if loss_type == "luspo" else "token",
        beta=float(beta),
        seed=0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        cost_aware_kept_fraction=0.5,
    )
    trainer = CostAwareGRPOTrainer(
        model=model_path,
        reward_funcs=varied_reward,
        args=config,
        train_dataset=arithmetic_dataset(32, seed=0),
        processing_class=tokenizer,
    )
    record = {"loss_tokens": [], "kl_scale": []}
    original_plan = trainer_module.plan_batch

    def plan_and_record(rows, settings, *a, **kw):
        plan = original_plan(rows, settings, *a, **kw)
        record["loss_tokens"].append(float(rows.loss_tokens.sum()))
        record["kl_scale"].append(plan.kl_scale)
        return plan

    trainer_module.plan_batch = plan_and_record
    try:
        before = flat_weights(trainer.model)
        trainer.train()
    finally:
        trainer_module.plan_batch = original_plan
    after = flat_weights(trainer.model)
    positions = torch.arange(1, len(after) + 1, dtype=torch.float64)
    record.update(
        log_history=trainer.state.log_history,
        checksum=float((after * positions).sum()),
        moved=float((after - before).abs().max()),
    )
    trainer.accelerator.wait_for_everyone()
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True, help="comma-separated LOSS:BETA:EMPTY (EMPTY: rank1 or all)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = {spec: run_case(spec, args.model, args.out) for spec in args.cases.split(",")}
    with open(os.path.join(args.out, f"rank{_rank()}.json"), "w") as fh:
        json.dump(results, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
