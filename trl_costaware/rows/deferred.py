"""The deferred no-grad log-prob passes: while TRL scores a generation batch, its old-policy and reference passes
return a placeholder (`placeholder_passes`, the one place that inspects a stack frame); the trainer runs them
afterwards on the kept micro-batches only (`CostAwareGRPOTrainer._compute_deferred_logps`), and with vLLM's
importance-sampling correction forms the ratio (and TRL's five vLLM metrics) over the kept rows (`ratio_stats`).
"""

from __future__ import annotations

import inspect
import math
import sys
from contextlib import contextmanager

import torch
from trl import GRPOTrainer

# The code object of TRL's scoring function: its direct calls to `_get_per_token_logps_and_entropies` are the passes
# that are deferred.
TRL_SCORING_CODE = inspect.unwrap(GRPOTrainer._generate_and_score_completions).__code__

# Entries of TRL's scored batch that the cost-aware trainer recomputes per kept micro-batch (placeholders until then).
DEFERRED_KEYS = ("old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")
# TRL's vLLM metrics, computed from its old-policy pass (deferred here): replaced by their values over the kept rows.
VLLM_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


@contextmanager
def placeholder_passes(trainer):
    """While TRL scores a generation batch, its no-grad log-prob passes (old policy, reference) return a NaN
    placeholder instead of running: the trainer runs them afterwards on the kept rows only. With the vLLM
    importance-sampling correction, TRL forms its ratio from the placeholder: NaN differences count as 0 there, so that
    ratio is 1 and cheap; the trainer drops it (`DEFERRED_KEYS`) and forms it again per kept micro-batch.

    Only TRL's own calls get the placeholder: those made directly from the body of
    `GRPOTrainer._generate_and_score_completions` (the caller's code object is checked). Anything else that runs
    meanwhile (reward functions, `rollout_func`, an environment) and calls `_get_per_token_logps_and_entropies` gets
    the real pass. Should TRL move its passes into a helper, they would simply run (correct, not deferred): the drift
    guard tests/test_trainer.py::test_dropped_rows_never_reach_a_forward then fails."""
    saved = vars(trainer).get("_get_per_token_logps_and_entropies")
    real = trainer._get_per_token_logps_and_entropies  # what any other caller gets, unchanged

    def placeholder(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if sys._getframe(1).f_code is not TRL_SCORING_CODE:  # a reward function, rollout_func, ...: real values
            return real(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        nan = torch.full((), math.nan, device=input_ids.device)
        return nan.expand(input_ids.size(0), logits_to_keep), None, None

    trainer._get_per_token_logps_and_entropies = placeholder
    try:
        yield
    finally:  # back to the class method, or to whatever instance attribute was there before
        vars(trainer).pop("_get_per_token_logps_and_entropies", None)
        if saved is not None:
            trainer._get_per_token_logps_and_entropies = saved


def deferred_passes(
    gradient_accumulation_steps: int, steps_per_generation: int, num_iterations: int, vllm_is: bool, beta: float
) -> tuple[bool, bool]:
    """(old policy, reference): whether TRL's `_generate_and_score_completions` runs each pass, by TRL's own
    conditions: the old-policy pass when gradient_accumulation_steps is not a multiple of steps_per_generation ×
    num_iterations, or under the vLLM importance-sampling correction (`vllm_is`); the reference pass when beta != 0.
    Otherwise TRL's loss uses the policy pass's own detached log-probs (ratio exactly 1)."""
    return gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0 or vllm_is, beta != 0.0


def ratio_stats(chunk: dict, mask: torch.Tensor, sequence_mode: bool) -> torch.Tensor:
    """On the chunk's device, no transfer, float32: [Σ|Δ|, count, max |Δ|, min r, Σ r, count r, max r] over the loss
    tokens `mask` (Δ = old − sampling log-prob, NaN excluded; r per token, or per row for the sequence modes), as TRL
    logs them over the full batch."""
    mask = mask.bool()
    delta = (chunk["old_per_token_logps"] - chunk["sampling_per_token_logps"]).abs().float()
    valid = mask & ~torch.isnan(delta)
    ratio = chunk["importance_sampling_ratio"].float()
    on = valid.new_ones(ratio.shape) if sequence_mode else mask
    zero = delta.new_zeros(())
    inf = delta.new_full((), math.inf)
    return torch.stack(
        [
            torch.where(valid, delta, zero).sum(),
            valid.sum().float(),
            torch.where(valid, delta, -inf).amax(),
            torch.where(on, ratio, inf).amin(),
            torch.where(on, ratio, zero).sum(),
            on.sum().float(),
            torch.where(on, ratio, -inf).amax(),
        ]
    )
