"""`make demo`: GRPO and Cost-Aware GRPO side by side on the embedded default (tiny model, arithmetic task).

    python -m trl_costaware.demo [--steps 100] [--output_dir outputs/demo] [--seed 0]

Builds (or reuses) the tiny model and its SFT warm-up, trains both arms from the same checkpoint with the same
seed and the same rollout budget, and prints reward and policy-optimisation tokens for each.
"""

from __future__ import annotations

import argparse
import os
import time

# The GRPO recipe of the token-efficiency benchmark (BENCHMARKS.md): 16 prompts x 16 rollouts per step, one optimizer
# step per generation batch, constant Adam lr 1e-4, dapo loss, no KL. Higher learning rates make GRPO on this tiny
# model degrade (lr 1e-3 collapses the reward), smaller batches make it flat.
# GRPO takes ~0.35 s per step on one idle core (several times more on a busy one).
DEMO_SETTINGS = dict(
    per_device_train_batch_size=256,
    num_generations=16,
    steps_per_generation=1,
    max_completion_length=20,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    loss_type="dapo",
    temperature=1.0,
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=False,
)


def _smoothed(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def run_arm(name: str, cost_aware: bool, args: argparse.Namespace, model_path: str):
    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded import arithmetic_dataset, arithmetic_reward

    config = CostAwareGRPOConfig(
        output_dir=os.path.join(args.output_dir, name),
        max_steps=args.steps,
        seed=args.seed,
        cost_aware=cost_aware,
        cost_aware_run_group="demo",
        **DEMO_SETTINGS,
    )
    prompts_per_step = DEMO_SETTINGS["per_device_train_batch_size"] // DEMO_SETTINGS["num_generations"]
    dataset = arithmetic_dataset(args.steps * prompts_per_step + 64, seed=args.seed)
    trainer = CostAwareGRPOTrainer(model_path, [arithmetic_reward], args=config, train_dataset=dataset)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    rows = [r for r in trainer.state.log_history if "reward" in r]
    rewards = [r["reward"] for r in rows]
    tokens = [r["cost_aware/policy_tokens"] for r in rows]
    # The first points of a moving average rest on a few noisy batches; like `trl-costaware compare`, start the
    # curve once the window is full, so an early lucky batch does not count as the peak.
    skip = min(max(args.smooth - 1, 0), len(rewards) - 1)
    smooth = _smoothed(rewards, args.smooth)[skip:]
    tokens = tokens[skip:]
    return {
        "name": name,
        "rewards": smooth,
        "tokens": tokens,
        "final": smooth[-1],
        "peak": max(smooth),
        "policy_tokens": tokens[-1],
        "generated_tokens": rows[-1]["cost_aware/generated_tokens"],
        "wall": wall,
    }


def tokens_to_reach(arm: dict, target: float) -> float | None:
    for reward, tokens in zip(arm["rewards"], arm["tokens"], strict=True):
        if reward >= target:
            return tokens
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per arm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window over logged rewards")
    parser.add_argument("--output_dir", default="outputs/demo")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")

    from trl_costaware.embedded import evaluate_accuracy, warmed_up_model_path

    print("Building the embedded tiny model and its SFT warm-up (cached after the first run) ...", flush=True)
    model_path = warmed_up_model_path()
    print(f"  model: {model_path}", flush=True)
    print(f"  warm-up accuracy (greedy, held-out): {evaluate_accuracy(model_path, n=64, seed=12345):.3f}", flush=True)

    arms = [run_arm("grpo", False, args, model_path), run_arm("cost_aware_grpo", True, args, model_path)]
    baseline = arms[0]
    print()
    print(f"Embedded default, {args.steps} steps per arm, same seed and rollouts; reward smoothed over {args.smooth}.")
    header = (
        "| arm | final reward | peak reward | policy tokens | generated tokens | tokens to baseline peak | wall s |"
    )
    print(header)
    print("|" + "---|" * 7)
    for arm in arms:
        reach = tokens_to_reach(arm, baseline["peak"])
        reach_text = "not reached" if reach is None else f"{reach:,.0f}"
        print(
            f"| {arm['name']} | {arm['final']:.3f} | {arm['peak']:.3f} | {arm['policy_tokens']:,.0f} | "
            f"{arm['generated_tokens']:,.0f} | {reach_text} | {arm['wall']:.0f} |"
        )
    saved = 1 - arms[1]["policy_tokens"] / baseline["policy_tokens"]
    print(f"\nCost-aware GRPO used {saved:.0%} fewer policy-optimisation tokens over the same rollouts.")
    print(
        f"Metric histories: {args.output_dir}/<arm>/ ; compare them with `trl-costaware compare {args.output_dir}/*`."
    )


if __name__ == "__main__":
    main()
