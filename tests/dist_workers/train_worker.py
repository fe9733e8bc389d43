"""Worker for tests/test_distributed.py: a few Cost-Aware GRPO steps on the embedded tiny model, then dump results.

Launched with `torchrun --nproc_per_node 2` or `accelerate launch --config_file ...` (two CPU processes, gloo).
Each rank writes to --out:

    rank{r}.pt     the full final state dict (float32, CPU; ZeRO-3 parameters gathered first)
    rank{r}.json   log history, the globally normalised weight vector of every generation batch as this rank saw
                   it, the factors this rank applied, its kept-row count (and, under a token budget, the count its
                   own budget gave, before the reduction over ranks), and the backend it ran under

The parent test compares these across ranks and across backends. Two reward modes:

    varied          every rank has within-group reward variance (position in group + digit count)
    rank_dependent  rank 0 as `varied`, every other rank a constant reward (all advantages zero there)

The DeepSpeed config comes from the launcher (`accelerate launch` with a DeepSpeed yaml; `use_cpu: true` is then set
on the training arguments when there is no GPU) or from --deepspeed (a JSON path passed to `CostAwareGRPOConfig`).
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
    """Position in the group plus a small text-dependent term: every group of NUM_GENERATIONS has variance."""
    return [float(i % NUM_GENERATIONS) + 0.1 * sum(ch.isdigit() for ch in str(c)) for i, c in enumerate(completions)]


def rank_dependent_reward(completions, **kwargs) -> list[float]:
    """`varied_reward` on rank 0; a constant on the other ranks, so their advantages are all exactly zero."""
    if _rank() == 0:
        return varied_reward(completions)
    return [0.5] * len(completions)


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON config (else: whatever the launcher set up)")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--reward", choices=["varied", "rank_dependent"], default="varied")
    p.add_argument("--weight-normalization", default="recenter")
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--per-device-batch", type=int, default=4)
    p.add_argument("--kept-fraction", type=float, default=0.5)
    p.add_argument("--token-budget", type=int, default=None, help="cost_aware_token_budget (replaces the fraction)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--max-completion-length", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["packed", "even"], default=None, help="force a layout (else the trainer's)")
    p.add_argument("--optim", default="adamw_torch", help="sgd: the weights move by the gradient itself")
    p.add_argument("--rank0-log", action="store_true", help="a callback calls trainer.log on rank 0 only, every step")
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--shared-prompt", action="store_true", help="shared_prompt_forward=True")
    p.add_argument("--plain", action="store_true", help="cost_aware=False (plain GRPO)")
    return p.parse_args(argv)


def _zero_stage(trainer) -> int:
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


def full_state_dict(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the trained model, float32 on CPU; ZeRO-3 shards are gathered first."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if _zero_stage(trainer) == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    using_ds = args.deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    ds_stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if args.deepspeed is not None:
        with open(args.deepspeed) as fh:
            ds_stage = str(json.load(fh).get("zero_optimization", {}).get("stage", 0))
    if using_ds and not torch.cuda.is_available():
        # CPU DeepSpeed: no NCCL/oneCCL here, so DeepSpeed's communication must run over gloo; doing it before the
        # trainer is built makes accelerate reuse this process group (needed for ZeRO-3, harmless for ZeRO-2).
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")

    from transformers import AutoTokenizer

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware import trainer as trainer_module
    from trl_costaware.embedded.arithmetic import arithmetic_dataset
    from trl_costaware.rows.plan import token_budget_count

    os.makedirs(args.out, exist_ok=True)
    config = CostAwareGRPOConfig(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.grad_accum,
        num_generations=NUM_GENERATIONS,
        max_completion_length=args.max_completion_length,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=args.beta,
        seed=args.seed,
        bf16=False,
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
        deepspeed=args.deepspeed,
        logging_steps=args.logging_steps,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        cost_aware_kept_fraction=args.kept_fraction,
        cost_aware_token_budget=args.token_budget,
        cost_aware_weight_normalization=args.weight_normalization,
        optim=args.optim,
        shared_prompt_forward=args.shared_prompt,
        cost_aware=not args.plain,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        )

    reward = varied_reward if args.reward == "varied" else rank_dependent_reward
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    trainer = CostAwareGRPOTrainer(
        model=args.model,
        reward_funcs=reward,
        args=config,
        train_dataset=arithmetic_dataset(64, seed=args.seed),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if args.layout is not None:  # the trainer reads `_layout` when it draws and lays out a generation batch
        trainer._cost_aware.layout = args.layout

    # Record what the sampler normalised (the weights of all ranks' slots, fillers 0) and what this rank applied.
    record = {
        "global_weights": [],
        "global_filler": [],
        "factors": [],
        "kept": [],
        "budget_rows": [],
        "eligible_rows": [],
        "kept_multiple": [],
    }
    original_plan = trainer_module.plan_batch
    original_draw = trainer._draw_kept_rows

    def plan_and_record(rows, settings, *a, **kw):
        plan = original_plan(rows, settings, *a, **kw)
        record["global_weights"].append(plan.global_weights.tolist())
        record["global_filler"].append(plan.global_filler.tolist())
        if settings.token_budget is not None:  # this rank's own count, before the reduction over ranks
            own = token_budget_count(rows, plan.p, plan.eligible, settings.token_budget)
            record["budget_rows"].append(own)
        record["eligible_rows"].append(int(plan.eligible.sum()))  # this rank's rows that can carry gradient
        record["kept_multiple"].append(settings.kept_multiple)
        return plan

    def draw_and_record(batch):
        plan = original_draw(batch)
        record["factors"].append(plan.factors.tolist())
        record["kept"].append(len(plan.indices))
        return plan

    trainer_module.plan_batch = plan_and_record  # the trainer calls plan_batch through its module global
    trainer._draw_kept_rows = draw_and_record
    if args.rank0_log:
        from transformers import TrainerCallback

        # A user's callback that logs from the main process only, as a step begins (at its end transformers' own
        # flow would break: `log` clears `control.should_log` on that rank only, so only the other rank would log).
        class RankZeroLog(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.is_world_process_zero:
                    trainer.log({"rank0_only": float(state.global_step)})

        trainer.add_callback(RankZeroLog())

    trainer.train()

    rank = trainer.accelerator.process_index
    state = full_state_dict(trainer)
    torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))
    real_micro_batches = sum(not step.noop for step in trainer._cost_aware.generation.micro_steps or [])
    summary = {
        "rank": rank,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": _zero_stage(trainer),
        "layout": trainer._cost_aware.layout,
        "micro_batches": real_micro_batches,  # of the last generation batch
        "ds_stage_requested": ds_stage,
        "lora": args.lora,
        "log_history": trainer.state.log_history,
        **record,
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(summary, fh)
    trainer.accelerator.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
