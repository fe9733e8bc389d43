"""The deferred no-grad log-prob passes: while TRL scores a batch, its old-policy and reference passes return a
placeholder (`scoring_window`: a flag, no stack inspection); the trainer runs them on the kept micro-batches only
(`_compute_deferred_logps`) and, with vLLM's correction, forms the ratio and TRL's vLLM metrics there (`ratio_stats`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

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
def scoring_window(state):
    """Around TRL's `_generate_and_score_completions`: `state.deferring` (the trainer's `CostAwareState`; None outside,
    False inside) is set by the trainer's `_generate` once generation has returned and cleared by its
    `_calculate_rewards` before any reward function runs: only TRL's log-prob passes between the two get
    `placeholder_logps`. Should TRL stop calling `_generate` there, the passes run (correct, not deferred) and
    test_dropped_rows_never_reach_a_forward fails."""
    state.deferring = False
    try:
        yield
    finally:
        state.deferring = None


def placeholder_logps(input_ids: torch.Tensor, logits_to_keep: int):
    """A deferred pass's result: NaN log-probs of the right shape (an expanded 0-dim tensor), no entropies. TRL's vLLM
    ratio formed from them is 1 (NaN differences count as 0); the trainer drops it (`DEFERRED_KEYS`) and recomputes."""
    nan = torch.full((), math.nan, device=input_ids.device)
    return nan.expand(input_ids.size(0), logits_to_keep), None, None


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
