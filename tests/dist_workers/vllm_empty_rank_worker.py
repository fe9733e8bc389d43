"""Worker for tests/test_vllm_distributed.py: TRL's vLLM importance-sampling metrics on two ranks when one rank has no
real micro-batch.

Launched with `torchrun --nproc_per_node 2` (two CPU processes, gloo). vLLM (colocate mode) is the stand-in engine of
tests/test_vllm.py (an HF copy of the policy behind TRL's own `VLLMGeneration`), with noisy, partly NaN log-probs so
that every branch of the ratio acts. Each case generates one generation batch per rank through TRL's
`_prepare_inputs` (generation, scoring, the cost-aware draw, TRL's shuffle and split, then the trainer's
`_process_new_buffer`: layout, deferred old-policy pass, vLLM ratio, its metrics' gather):

    empty  rank 1's packed layout is replaced by no-ops at every micro-step position (no real micro-batch there; the
           standard layout never does this, since every rank keeps the same m rows, but a subclass's own layout or
           draw can, and `_log_vllm_ratio` must then still take part in the gather)
    both   both ranks as the layout made them (the control)

Both cases run for each vLLM importance-sampling mode given (one launch). Each rank writes rank{r}.json: per mode and
case, the five `sampling/*` metrics it logged, its counters, and, from its own real
micro-batches (computed here the way TRL computes them over its batch), its per-rank statistics, so that the parent
can reduce them over ranks as TRL does and compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the stand-in vLLM of test_vllm.py

NUM_GENERATIONS = 4


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def varied_reward(completions, **kwargs) -> list[float]:
    return [float(i % NUM_GENERATIONS) + 0.1 * len(str(c)) for i, c in enumerate(completions)]


def stand_in_vllm():
    """TRL's vLLM colocate path wired to test_vllm's stand-in engine (what its `stand_in_vllm` fixture patches)."""
    import test_vllm as tv
    from trl.generation import vllm_generation as generation_module

    generation_module.is_vllm_available = lambda: True
    generation_module.LLM = tv.StandInLLM
    generation_module.SamplingParams = tv.StandInSamplingParams
    tv.StandInEngine.logp_noise = 0.15
    tv.StandInEngine.nan_every = 7


def rank_statistics(chunks, sequence: bool) -> dict:
    """This rank's statistics over its real micro-batches, as TRL forms them over its batch in
    `_generate_and_score_completions` (a statistic over no token is 0)."""
    deltas, ratios = [], []
    for c in chunks:
        mask = c["completion_mask"].bool()
        delta = (c["old_per_token_logps"] - c["sampling_per_token_logps"]).abs()
        deltas.append(delta[mask & ~torch.isnan(delta)])
        ratio = c["importance_sampling_ratio"]
        ratios.append(ratio.flatten() if sequence else ratio[mask])
    delta = torch.cat(deltas) if deltas else torch.zeros(0)
    ratio = torch.cat(ratios) if ratios else torch.zeros(0)

    def stat(x, f):
        return float(f(x.double())) if x.numel() else 0.0

    return {
        "delta_mean": stat(delta, torch.mean),
        "delta_max": stat(delta, torch.max),
        "ratio_min": stat(ratio, torch.min),
        "ratio_mean": stat(ratio, torch.mean),
        "ratio_max": stat(ratio, torch.max),
        "tokens": int(delta.numel()),
        "real": len(chunks),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--modes", default="token_truncate,sequence_mask", help="vLLM IS modes, one pair of cases each")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    stand_in_vllm()

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded.arithmetic import arithmetic_dataset
    from trl_costaware.rows.batching import noop_micro_batch
    from trl_costaware.rows.deferred import VLLM_METRICS
    from trl_costaware.rows.packed import NOOP

    config = CostAwareGRPOConfig(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=NUM_GENERATIONS,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-3,
        seed=0,
        bf16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        beta=0.0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_importance_sampling_clip_min=0.8,
        vllm_importance_sampling_clip_max=1.25,
        cost_aware_kept_fraction=0.5,
    )
    trainer = CostAwareGRPOTrainer(
        model=args.model, reward_funcs=varied_reward, args=config, train_dataset=arithmetic_dataset(64, seed=0)
    )
    assert trainer.use_vllm and trainer.vllm_importance_sampling_correction
    trainer.model.train()
    batches = iter(trainer.get_train_dataloader())
    original_pack = trainer._packed_chunks
    empty_here = {"on": False}

    def pack(kept_batch, chunks, host, plan):
        out = original_pack(kept_batch, chunks, host, plan)
        if not empty_here["on"]:
            return out
        return [(noop_micro_batch(kept_batch), NOOP) for _ in out]

    trainer._packed_chunks = pack
    results = {}
    cases = [(mode, case) for mode in args.modes.split(",") for case in ("empty", "both")]
    for mode, case in cases:
        trainer.vllm_importance_sampling_mode = mode  # TRL's attribute, read per generation batch
        empty_here["on"] = case == "empty" and _rank() == 1
        for key in VLLM_METRICS:
            trainer._metrics["train"][key].clear()
        trainer._buffered_inputs, trainer._step = None, 0
        trainer._prepare_inputs(next(batches))
        chunks = trainer._buffered_inputs
        real = [c for c, step in zip(chunks, trainer._cost_aware.generation.micro_steps, strict=True) if not step.noop]
        results.setdefault(mode, {})[case] = {
            "metrics": {key: list(trainer._metrics["train"][key]) for key in VLLM_METRICS},
            "totals": dict(trainer._cost_aware.totals),
            "stats": rank_statistics(real, mode.startswith("sequence")),
            "positions": len(chunks),
        }
    trainer.accelerator.wait_for_everyone()
    results["world_size"] = trainer.accelerator.num_processes
    with open(os.path.join(args.out, f"rank{_rank()}.json"), "w") as fh:
        json.dump(results, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
