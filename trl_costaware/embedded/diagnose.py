"""What a testbed's rollouts look like at the start of GRPO, and whether the testbed has the properties it claims.

    python -m trl_costaware.embedded.diagnose --testbed long
    python -m trl_costaware.embedded.diagnose --testbed long --results benchmarks/results/token_efficiency_long.json

Samples `--batches` generation batches (default 8 on long, 2 on default) from the warmed-up model (the shipped
weights, `shipped.py`; their SHA-256 is printed) exactly as the testbed's GRPO recipe does (training prompts of seed
0 onwards, `num_generations` rollouts per prompt, T = 1, the recipe's length cap), scores them with the task's reward
and prints, over all those rollouts:

- completion lengths (EOS included): p10 / median / p90, p90/p10, the cap, the fraction truncated at the cap (no EOS
  within it);
- mean length of wrong and of right completions, and their ratio;
- the prompt's share of the mean rollout cost (prompt + completion tokens);
- the theory's numbers per generation batch, with G_i = |A_i| (GRPO's group advantages, std-scaled as TRL does by
  default) and c_i = prompt + completion tokens: the best cost ratio any row choice allows against uniform
  subsampling, J(p*)/J(u) = (Σ G√c)² / (Σ G² · Σ c), and the ratio of the method's own distribution (∝ |A|/√c
  smoothed by α = 0.1 over the rows with A ≠ 0), J(p)/J(u).

With `--results` (the JSON written by `benchmarks/token_efficiency.py`) it adds the properties that need training
runs: GRPO's held-out improvement over seeds (mean, bootstrap 95% interval), uniform subsampling at kept fraction 0.25
against GRPO in steps to the target, and the mean training wall of a GRPO run. Every property is printed with its
criterion and whether it holds; nothing is hidden when one does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from .shipped import SHIPPED

# The criteria of the long testbed (docs/embedded.md).
CRITERIA = {
    "length_spread": ("p90/p10 of completion lengths", ">= 6", lambda v: v >= 6),
    "cap": ("length cap (tokens)", ">= 96", lambda v: v >= 96),
    "truncated": ("rollouts truncated at the cap", "10-30%", lambda v: 0.10 <= v <= 0.30),
    "wrong_over_right": ("mean length wrong / right", ">= 1.5", lambda v: v >= 1.5),
    "prompt_share": ("prompt share of mean rollout cost", "<= 25%", lambda v: v <= 0.25),
    "grpo_gain": ("GRPO held-out gain (mean over seeds)", ">= +0.15", lambda v: v >= 0.15),
    "grpo_gain_low": ("GRPO held-out gain, 95% CI low end", "> +0.10", lambda v: v > 0.10),
    "uniform_0.25_steps": ("uniform 0.25 steps to target / GRPO", ">= 1.2", lambda v: v >= 1.2),
    "run_wall_s": ("GRPO run, training wall (s, one core)", "<= 180", lambda v: v <= 180),
}


# Generation batches per testbed: 1,024 long rollouts, 2,048 default ones.
DEFAULT_BATCHES = {"long": 8, "default": 2}


def group_advantages(rewards, num_generations: int):
    """GRPO's advantages as TRL computes them by default (scale_rewards="group"):
    (r − group mean) / (group std + 1e-4), std with Bessel's correction."""
    import torch

    r = torch.as_tensor(rewards, dtype=torch.float32).view(-1, num_generations)
    mean = r.mean(1, keepdim=True)
    std = r.std(1, keepdim=True)
    return ((r - mean) / (std + 1e-4)).flatten()


def rollout_stats(testbed: str = "long", batches: int = 4, seed: int = 0) -> dict[str, Any]:
    """Sample `batches` generation batches at the start of GRPO and measure them (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    from ..rows.sampling import j_ratio_achieved, j_ratio_ideal, sampling_distribution
    from .shipped import file_sha256
    from .testbed import get_testbed
    from .warmup import sample_completions

    bed = get_testbed(testbed)
    recipe = bed.recipe
    g = recipe["num_generations"]
    rows = recipe["per_device_train_batch_size"] * recipe.get("steps_per_generation", 1)
    cap = recipe["max_completion_length"]
    path = bed.model_path()
    weights_sha256 = file_sha256(os.path.join(path, "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(path)
    ds = bed.dataset(batches * rows // g, seed)
    prompts = list(ds["prompt"])
    texts = sample_completions(
        path, prompts, tokenizer=tok, num_generations=g, do_sample=True, max_new_tokens=cap, seed=seed, batch_size=rows
    )
    answers = [a for a in ds["answer"] for _ in range(g)]
    rewards = bed.reward(texts, answers)
    raw = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    truncated = [n >= cap for n in raw]
    lengths = [min(cap, n + 1) for n in raw]  # + EOS when the completion stopped
    prompt_tokens = [len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts for _ in range(g)]
    right = [n for n, r in zip(lengths, rewards, strict=True) if r > 0]
    wrong = [n for n, r in zip(lengths, rewards, strict=True) if r <= 0]
    deciles = statistics.quantiles(lengths, n=10)
    per_batch = []
    for b in range(batches):
        sl = slice(b * rows, (b + 1) * rows)
        adv = group_advantages(rewards[sl], g)
        cost = torch.tensor([p + c for p, c in zip(prompt_tokens[sl], lengths[sl], strict=True)], dtype=torch.float64)
        gabs = adv.abs().double()
        support = gabs > 0
        p = sampling_distribution(gabs / cost.sqrt(), alpha=0.1, support=support)
        per_batch.append(
            {
                "j_ideal": j_ratio_ideal(gabs, cost),
                "j_method": j_ratio_achieved(gabs, cost, p),
                "informative_rows": float(support.double().mean()),
            }
        )
    mean_cost = statistics.mean(p + c for p, c in zip(prompt_tokens, lengths, strict=True))
    return {
        "testbed": testbed,
        "model": path,
        "weights_sha256": weights_sha256,
        "shipped": weights_sha256 == SHIPPED[bed.warmup].sha256 if bed.warmup in SHIPPED else False,
        "rollouts": len(texts),
        "batches": batches,
        "cap": cap,
        "length_p10": deciles[0],
        "length_median": statistics.median(lengths),
        "length_p90": deciles[-1],
        "length_spread": deciles[-1] / max(1.0, deciles[0]),
        "truncated": sum(truncated) / len(truncated),
        "reward_mean": sum(rewards) / len(rewards),
        "mean_length_right": statistics.mean(right) if right else None,
        "mean_length_wrong": statistics.mean(wrong) if wrong else None,
        "wrong_over_right": statistics.mean(wrong) / statistics.mean(right) if right and wrong else None,
        "prompt_share": statistics.mean(prompt_tokens) / mean_cost,
        "mean_rollout_cost": mean_cost,
        "per_batch": per_batch,
        "j_ideal_mean": statistics.mean(b["j_ideal"] for b in per_batch),
        "j_method_mean": statistics.mean(b["j_method"] for b in per_batch),
        "informative_rows_mean": statistics.mean(b["informative_rows"] for b in per_batch),
    }


def run_properties(results: dict[str, Any]) -> dict[str, Any]:
    """The properties that need training runs, from `benchmarks/token_efficiency.py`'s result JSON: GRPO's mean
    held-out gain and its interval's low end, uniform 0.25's steps-to-target ratio against GRPO (paired seeds), and
    the mean training wall of a GRPO run."""
    out: dict[str, Any] = {}
    gain = results.get("grpo_improvement") or {}
    if gain.get("mean") is not None:
        out["grpo_gain"] = gain["mean"]
        out["grpo_gain_low"] = (gain.get("ci95") or [None])[0]
    arms = results.get("arms") or {}
    steps = ((arms.get("uniform_0.25") or {}).get("ratio_vs_grpo") or {}).get("step") or {}
    if (steps.get("ci") or [None])[0] is not None:
        out["uniform_0.25_steps"] = steps["ci"][0]
    if (arms.get("grpo") or {}).get("train_wall_s") is not None:
        out["run_wall_s"] = arms["grpo"]["train_wall_s"]
    return {k: v for k, v in out.items() if v is not None}


def report(stats: dict[str, Any], runs: dict[str, Any] | None = None) -> str:
    """A markdown table: each property, its value, its criterion and whether it holds."""
    values = {k: stats.get(k) for k in ("length_spread", "cap", "truncated", "wrong_over_right", "prompt_share")}
    values.update(runs or {})
    lines = [
        f"Testbed {stats['testbed']!r} at the start of GRPO: {stats['rollouts']} rollouts in {stats['batches']} "
        f"generation batches, model {stats['model']}",
        _weights_line(stats),
        f"completion length p10 / median / p90 = {stats['length_p10']:.0f} / {stats['length_median']:.0f} / "
        f"{stats['length_p90']:.0f} tokens; reward mean {stats['reward_mean']:.3f}; mean length right "
        f"{_fmt(stats['mean_length_right'])}, wrong {_fmt(stats['mean_length_wrong'])}; mean rollout cost "
        f"{stats['mean_rollout_cost']:.1f} tokens",
        "theory per batch (G = |A|, c = prompt + completion): best row choice J(p*)/J(u) = "
        f"{stats['j_ideal_mean']:.3f}, "
        f"the method's p (|A|/sqrt(c), alpha 0.1) J(p)/J(u) = {stats['j_method_mean']:.3f}; rows with A != 0: "
        f"{stats['informative_rows_mean']:.2f}",
        "",
        "| property | measured | criterion | holds |",
        "|---|---|---|---|",
    ]
    for key, (label, rule, check) in CRITERIA.items():
        v = values.get(key)
        if v is None:
            lines.append(f"| {label} | not measured | {rule} | — |")
            continue
        shown = f"{v:.1%}" if key in ("truncated", "prompt_share") else f"{v:.3g}"
        lines.append(f"| {label} | {shown} | {rule} | {'yes' if check(v) else 'NO'} |")
    return "\n".join(lines)


def _weights_line(stats: dict[str, Any]) -> str:
    sha = stats.get("weights_sha256")
    if sha is None:
        return "weights sha256 not recorded"
    which = "the shipped weights" if stats.get("shipped") else "NOT the shipped weights (a rebuild, or another model)"
    return f"weights sha256 {sha}: {which}"


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--testbed", default="long", choices=("default", "long"))
    parser.add_argument(
        "--batches", type=int, default=None, help="generation batches to sample (default: 8 on long, 2 on default)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=None, help="token_efficiency.py result JSON for the run properties")
    parser.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    args = parser.parse_args(argv)
    batches = DEFAULT_BATCHES[args.testbed] if args.batches is None else args.batches
    stats = rollout_stats(args.testbed, batches, args.seed)
    runs = None
    if args.results:
        with open(args.results, encoding="utf-8") as fh:
            runs = run_properties(json.load(fh))
    print(report(stats, runs))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rollouts": stats, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
