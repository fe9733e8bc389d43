"""TRL's vLLM importance-sampling correction, as a pure function of one batch's rows.

TRL 1.16 forms this ratio inline in `_generate_and_score_completions` after its old-policy pass over every row; row
i's ratio depends on row i alone, so the trainer forms it per kept micro-batch instead (tests/test_vllm.py compares
it with TRL's, mode by mode). With d_it = (old_it − sampling_it) · mask_it, NaN → 0: token_* modes r_it = exp(d_it)
(B, T); sequence_* modes r_i = exp(Σ_t d_it) (B, 1); *_truncate clamps r to [clip_min, clip_max], *_mask zeroes r
outside it (a bound that is None is not applied). `combine_ratio_stats` sums one rank's micro-batch statistics (a
rank with no real micro-batch still sends them); `vllm_metrics` forms TRL's five `sampling/*` metrics over ranks as
TRL does (mean of per-rank means, extreme of per-rank extremes).
"""

from __future__ import annotations

import math

import torch

VLLM_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def vllm_importance_sampling_ratio(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's `importance_sampling_ratio` for these rows (formula in the module docstring).

    `old_per_token_logps`, `sampling_per_token_logps`, `mask`: (B, T); `mask` is the completion mask, times the tool
    mask when the batch has one. `mode`, `clip_min`, `clip_max`: `args.vllm_importance_sampling_mode`,
    `args.vllm_importance_sampling_clip_min`, `args.vllm_importance_sampling_clip_max`. Returns (B, T) for the token
    modes, (B, 1) for the sequence modes.
    """
    if mode not in VLLM_IS_MODES:
        raise ValueError(
            f"Unknown vLLM importance sampling level: {mode}. Possible values are 'token_truncate', 'token_mask', "
            "'sequence_truncate', and 'sequence_mask'."
        )
    diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


# The statistics of no token ([Σ|Δ|, n_Δ, max |Δ|, min r, Σ r, n_r, max r]): the identity of `combine_ratio_stats`.
NO_TOKEN_STATS = (0.0, 0.0, -math.inf, math.inf, 0.0, 0.0, -math.inf)


def combine_ratio_stats(per_micro_batch: torch.Tensor) -> torch.Tensor:
    """One rank's statistics from those of its micro-batches: `per_micro_batch` (K, 7), rows [Σ|Δ|, n_Δ, max |Δ|,
    min r, Σ r, n_r, max r] as in `vllm_metrics`, K ≥ 0. Returns (7,), on the same device and dtype:

        [Σ_k Σ|Δ|_k, Σ_k n_Δ,k, max_k max |Δ|_k, min_k min r_k, Σ_k Σ r_k, Σ_k n_r,k, max_k max r_k],

    each reduction started from `NO_TOKEN_STATS` (0 for a sum, −∞ for a max, +∞ for a min), so K = 0 (a rank with no
    real micro-batch) gives `NO_TOKEN_STATS`: a rank without a token, which `vllm_metrics` counts as TRL does."""
    if per_micro_batch.dim() != 2 or per_micro_batch.shape[1] != 7:
        raise ValueError(f"expected (micro-batches, 7) statistics, got shape {tuple(per_micro_batch.shape)}")
    identity = torch.tensor(NO_TOKEN_STATS, dtype=per_micro_batch.dtype).to(per_micro_batch.device)
    s = torch.cat([identity.unsqueeze(0), per_micro_batch])
    return torch.stack(
        [
            s[:, 0].sum(),
            s[:, 1].sum(),
            s[:, 2].amax(),
            s[:, 3].amin(),
            s[:, 4].sum(),
            s[:, 5].sum(),
            s[:, 6].amax(),
        ]
    )


def vllm_metrics(per_rank: torch.Tensor) -> tuple[float, float, float, float, float]:
    """TRL's five vLLM metrics (`sampling/sampling_logp_difference/{mean,max}`, `sampling/importance_sampling_ratio/
    {min,mean,max}`) from each rank's statistics, reduced over ranks as `GRPOTrainer._generate_and_score_completions`
    reduces them.

    `per_rank` (R, 7), one row per rank: [Σ|Δ|, n_Δ, max |Δ|, min r, Σ r, n_r, max r] over that rank's loss tokens
    (Δ = old − sampling log-prob, NaN excluded; r per token, or per row for the sequence modes). Per rank,
    mean |Δ| = Σ|Δ|/n_Δ and mean r = Σr/n_r, and a statistic over no token is 0 (as TRL's `torch.tensor(0.0)`). Then

        logp_difference/mean = (1/R) Σ_ranks mean |Δ|        logp_difference/max = max_ranks max |Δ|
        ratio/min = min_ranks min r      ratio/mean = (1/R) Σ_ranks mean r      ratio/max = max_ranks max r

    (TRL's nan-aware reductions over ranks: the per-rank values here are never NaN.) A rank with many tokens weighs
    as much as a rank with few, exactly as in TRL's charts of the same names.
    """
    s = per_rank.double()
    has_d, has_r = s[:, 1] > 0, s[:, 5] > 0
    zero = torch.zeros(len(s), dtype=torch.float64)
    d_mean = torch.where(has_d, s[:, 0] / s[:, 1].clamp(min=1.0), zero)
    d_max = torch.where(has_d, s[:, 2], zero)
    r_min = torch.where(has_r, s[:, 3], zero)
    r_mean = torch.where(has_r, s[:, 4] / s[:, 5].clamp(min=1.0), zero)
    r_max = torch.where(has_r, s[:, 6], zero)
    return (
        float(d_mean.mean()),
        float(d_max.max()),
        float(r_min.min()),
        float(r_mean.mean()),
        float(r_max.max()),
    )
