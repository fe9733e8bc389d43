"""Batch shapes: does the update's compute fall with the kept tokens at every micro-batch size? (docs/layout.md)

For per_device_train_batch_size B in {1, 2, 16} with 8 micro-steps per optimizer step (gradient_accumulation_steps =
steps_per_generation = 8), it trains, side by side in ONE process (or one launch of 2 processes), the arms

    grpo            GRPOTrainer's update (cost_aware=False)
    even_0.5        cost-aware, kept fraction 0.5, TRL's even split (m/S rows per micro-step)
    packed_0.5      cost-aware, kept fraction 0.5, the packed layout

(the layout is the trainer's choice, not a config field: the script forces it on each cost-aware arm's trainer)

each for `--steps` optimizer steps (one generation batch each) from the same start and seed, on the embedded long
testbed (the SFT-warmed tiny model, counting prompts, completions of 2 to 96 tokens, its task reward, 8 rollouts per
prompt, dapo loss; `trl_costaware.embedded.testbed.LONG_RECIPE` at B = 16). Per arm it counts, summed over ranks:

- grad tokens: tokens through the model with gradients on (`input_ids.numel()` of every training forward with grad
  enabled: padding included, no-op micro-steps included where they run);
- rollout tokens: real tokens (prompt + completion) of every generated row (`cost_aware/rollout_tokens`);
- kept tokens: real tokens of the rows the update trains on (`cost_aware/policy_tokens`; all rows for grpo);
- update seconds: time in `training_step` minus time in `_generate_and_score_completions` (generation, scoring, the
  sampler), i.e. the micro-steps' forward/backward plus the layout; the mean over ranks.

and derives, per arm, over its own generated rows (the arms' later generation batches differ, so each ratio is taken
against the arm's own rollouts):

    kept share      = kept tokens / rollout tokens
    compute         = (grad tokens / rollout tokens) / (grpo's grad tokens / grpo's rollout tokens)
    target share    = the kept share of the packed arm of the same B and fraction: what the sampler keeps when the
                      layout forces no extra rows (the even layout rounds m up to a multiple of 8)
    goal            compute <= 1.1 x target share
    update time     = update seconds / grpo's update seconds (same run, same process)

Backends: `single` (one process), `ddp`, `zero2`, `zero3` (2 CPU processes over gloo, the shipped accelerate configs
with `--num_processes 2 --mixed_precision no`). One command per backend; results merge into
`benchmarks/results/batch_shapes.json` and the table into `benchmarks/results/batch_shapes.md`:

    python benchmarks/batch_shapes.py --backend single   # and ddp, zero2, zero3
    python benchmarks/batch_shapes.py --smoke --out /tmp/bs   # the machinery only: B = 2, 1 step (its test)

CPU, float32, a shared machine: wall times are noisy (compare arms within one backend's run only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
OUT = os.path.join(RESULTS, "batch_shapes")
BACKENDS = {"single": None, "ddp": "multi_gpu", "zero2": "zero2", "zero3": "zero3"}
ARMS = {
    "grpo": {"cost_aware": False},
    # "layout" is not a config field: the trainer's layout is forced after construction; the proxy is the one the
    # committed results were measured with
    "even_0.5": {"cost_aware_kept_fraction": 0.5, "cost_aware_proxy": "advantage", "layout": "even"},
    "packed_0.5": {"cost_aware_kept_fraction": 0.5, "cost_aware_proxy": "advantage", "layout": "packed"},
}
SIZES = (1, 2, 16)
MICRO_STEPS = 8
GOAL = 1.1


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=list(BACKENDS), default="single")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (= generation batches) per arm")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results prefix (.json, .md; default benchmarks/results/batch_shapes)")
    p.add_argument("--smoke", action="store_true", help="the machinery only: B = 2, 1 step, 4 rollouts per prompt")
    p.add_argument("--worker", action="store_true", help="(internal) train the arms in this process")
    p.add_argument("--worker-out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.steps, args.num_generations = "2", 1, 4
        args.out = args.out or os.path.join(RESULTS, "tmp", "batch_shapes_smoke")  # never the committed results
    args.out = args.out or OUT
    return args


# ---------------------------------------------------------------------------------------------------- worker
def _train_arm(arm, size, args, model_path, tokenizer):
    import torch

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded.counting import LONG_MAX_COMPLETION_LENGTH, counting_dataset, counting_reward

    config = CostAwareGRPOConfig(
        output_dir=os.path.join("/tmp", f"batch_shapes_{os.getpid()}", f"{arm}_{size}"),
        per_device_train_batch_size=size,
        gradient_accumulation_steps=MICRO_STEPS,
        steps_per_generation=MICRO_STEPS,
        num_generations=args.num_generations,
        max_completion_length=LONG_MAX_COMPLETION_LENGTH,
        max_steps=args.steps,
        learning_rate=1e-4,
        loss_type="dapo",
        temperature=1.0,
        beta=0.0,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        **{k: v for k, v in ARMS[arm].items() if k != "layout"},
    )
    trainer = CostAwareGRPOTrainer(
        model=model_path,
        reward_funcs=counting_reward,
        args=config,
        train_dataset=counting_dataset(4096, seed=args.seed),
        processing_class=tokenizer,
    )
    if "layout" in ARMS[arm]:
        trainer._cost_aware.layout = ARMS[arm]["layout"]
    counts = {"grad_tokens": 0, "grad_forwards": 0, "train_s": 0.0, "generate_s": 0.0}

    def hook(module, args_, kwargs):
        if torch.is_grad_enabled() and module.training:
            counts["grad_tokens"] += kwargs["input_ids"].numel()
            counts["grad_forwards"] += 1

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                counts[name] += time.perf_counter() - start

        return wrapper

    trainer.training_step = timed("train_s", trainer.training_step)
    trainer._generate_and_score_completions = timed("generate_s", trainer._generate_and_score_completions)
    handle = trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer.train()
    handle.remove()
    totals = trainer._cost_aware.totals
    result = {
        **counts,
        "update_s": counts["train_s"] - counts["generate_s"],
        "rollout_tokens": totals["rollout_tokens"],
        "kept_tokens": totals["policy_tokens"],
        "policy_tokens_padded": totals["policy_tokens_padded"],
        "rows_generated": totals["rows_generated"],
        "rows_kept": totals["rows_kept"],
        "layout": trainer._cost_aware.layout if config.cost_aware else "grpo",
        "distributed_type": str(trainer.accelerator.distributed_type),
        "num_processes": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
    }
    trainer.accelerator.wait_for_everyone()
    del trainer
    gc.collect()
    return result


def worker(args) -> int:
    import torch

    torch.set_num_threads(1)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not torch.cuda.is_available():
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # CPU DeepSpeed over gloo (DEVELOPERS.md)
    from transformers import AutoTokenizer

    from trl_costaware.embedded import warmed_up_model_path

    model_path = warmed_up_model_path(seed=0, recipe="long")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rank = int(os.environ.get("RANK", "0"))
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for arm in args.arms.split(","):
            result = _train_arm(arm, size, args, model_path, tokenizer)
            results.append({"arm": arm, "size": size, **result})
            print(f"[rank {rank}] B={size} {arm}: {json.dumps(result)}", flush=True)
    with open(os.path.join(args.worker_out, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    return 0


# ---------------------------------------------------------------------------------------------------- parent
def _launch(args, out_dir) -> list[list[dict]]:
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("ACCELERATE_USE_CPU", None)  # it would drop the DeepSpeed plugin (DEVELOPERS.md)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    from _common import free_port

    port = free_port()  # not the default 29500: another launch on the machine may hold it
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    own = [
        os.path.abspath(__file__),
        "--worker",
        "--worker-out",
        out_dir,
        "--steps",
        str(args.steps),
        "--sizes",
        args.sizes,
        "--arms",
        args.arms,
        "--num-generations",
        str(args.num_generations),
        "--seed",
        str(args.seed),
    ]
    config = BACKENDS[args.backend]
    if config is None:
        cmd = [sys.executable, *own]
        ranks = 1
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"),
            "--num_processes",
            "2",
            "--mixed_precision",
            "no",
            "--main_process_port",
            str(port),
            *own,
        ]
        ranks = 2
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(ranks)]


def summarise(per_rank: list[list[dict]]) -> list[dict]:
    """Sum the per-rank counts (the trainer's totals are already global), derive the ratios against grpo."""
    rows = []
    for entries in zip(*per_rank, strict=True):
        first = entries[0]
        row = {k: first[k] for k in ("arm", "size", "layout", "distributed_type", "num_processes")}
        row["grad_tokens"] = sum(e["grad_tokens"] for e in entries)
        row["grad_forwards"] = sum(e["grad_forwards"] for e in entries)
        row["update_s"] = sum(e["update_s"] for e in entries) / len(entries)
        for key in ("rollout_tokens", "kept_tokens", "policy_tokens_padded", "rows_generated", "rows_kept"):
            row[key] = first[key]
        rows.append(row)
    by_size = {}
    for row in rows:  # an arm named twice (a repeat) is compared with the first grpo and packed row of its size
        by_size.setdefault(row["size"], []).append(row)
    for same_size in by_size.values():
        first = {}
        for row in same_size:
            row["kept_row_fraction"] = row["rows_kept"] / row["rows_generated"]
            row["kept_share"] = row["kept_tokens"] / row["rollout_tokens"]
            first.setdefault(row["arm"], row)
        grpo = first.get("grpo")
        for row in same_size:
            name = row["arm"]
            if grpo is None or name == "grpo":
                continue
            packed = first.get("packed_" + name.split("_", 1)[1])
            per_rollout = row["grad_tokens"] / row["rollout_tokens"]
            row["compute"] = per_rollout / (grpo["grad_tokens"] / grpo["rollout_tokens"])
            row["update_time"] = row["update_s"] / grpo["update_s"]
            if packed is not None:
                row["target_share"] = packed["kept_share"]
                row["goal_met"] = row["compute"] <= GOAL * row["target_share"]
    return rows


def table(results: dict) -> str:
    lines = [
        "| backend | B | arm | kept rows | kept share | target share | compute vs GRPO | compute ≤ 1.1 × target | "
        "update s | update time vs GRPO | forwards with grad |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend in BACKENDS:
        if backend not in results:
            continue
        for row in results[backend]["rows"]:
            goal = "—" if "goal_met" not in row else ("yes" if row["goal_met"] else "**no**")
            nan = float("nan")
            lines.append(
                f"| {backend} | {row['size']} | {row['arm']} | {row['kept_row_fraction']:.2f} | "
                f"{row['kept_share']:.2f} | {row.get('target_share', nan):.2f} | {row.get('compute', 1.0):.2f} | "
                f"{goal} | {row['update_s']:.2f} | {row.get('update_time', 1.0):.2f} | {row['grad_forwards']} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    start = time.time()
    per_rank = _launch(args, os.path.join("/tmp", f"batch_shapes_{args.backend}_{os.getpid()}"))
    rows = summarise(per_rank)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    path = args.out + ".json"
    results = json.load(open(path)) if os.path.exists(path) else {}
    results[args.backend] = {
        "command": f"python benchmarks/batch_shapes.py --backend {args.backend} --steps {args.steps} --sizes "
        f"{args.sizes} --num-generations {args.num_generations} --seed {args.seed}",
        "wall_s": time.time() - start,
        "steps": args.steps,
        "seed": args.seed,
        "rows": rows,
    }
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
    md = table(results)
    with open(args.out + ".md", "w") as fh:
        fh.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
