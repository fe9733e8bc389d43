"""Per-generation-batch diagnostics of the cost-aware draw: one pure function from per-rank sums to logged metrics."""

from __future__ import annotations

import torch

from .sampling import j_ratio_achieved, j_ratio_ideal


def rank_sums(
    advantages: torch.Tensor,
    costs: torch.Tensor,
    eligible: torch.Tensor,
    p: torch.Tensor,
    indices: torch.Tensor,
    rollout_lengths: torch.Tensor,
    generated_lengths: torch.Tensor,
    loss_tokens: torch.Tensor,
    draws: int,
) -> dict[str, float]:
    """This rank's additive statistics of one draw (summed over ranks by the caller, then fed to `batch_metrics`).

    rows N; draws m; kept = |{i : i drawn}|; informative = |{i : A_i ≠ 0 and T_i > 0}| (rows whose policy
    term is non-zero); eligible = |S| (the sampling support); kept_informative = informative rows in the sample;
    rollout_tokens = Σ_i (prompt + generated tokens) of every row, including tokens a truncation mask hides from the
    loss; kept_rollout_tokens = the same over drawn rows; loss_tokens and kept_loss_tokens = Σ T_i over all / drawn
    rows; j_ideal = J(p*)/J(u), j_achieved = J(p)/J(u) with g = |A| on rows with T_i > 0 (per rank, averaged)."""
    n = len(advantages)
    in_sample = torch.zeros(n, dtype=torch.bool)
    in_sample[indices] = True
    g = torch.nan_to_num(advantages.double()).abs() * (loss_tokens > 0)
    informative = g > 0
    return {
        "rows": float(n),
        "draws": float(draws),
        "kept": float(in_sample.sum()),
        "informative": float(informative.sum()),
        "kept_informative": float((informative & in_sample).sum()),
        "eligible": float(eligible.sum()),
        "zero_signal_ranks": float(not informative.any()),
        "j_ideal": j_ratio_ideal(g, costs),
        "j_achieved": min(j_ratio_achieved(g, costs, p), 1e6),
        "rollout_tokens": float(rollout_lengths.sum()),
        "kept_rollout_tokens": float(rollout_lengths[indices].sum()),
        "generated_tokens": float(generated_lengths.sum()),
        "loss_tokens": float(loss_tokens.sum()),
        "kept_loss_tokens": float(loss_tokens[indices].sum()),
        "ranks": 1.0,
    }


def batch_metrics(total: dict[str, float]) -> dict[str, float]:
    """Logged metrics (prefix `cost_aware/`) from the rank sums of `rank_sums`:

    kept_row_fraction = m/N; kept_token_fraction = kept rollout tokens / rollout
    tokens; kept_loss_token_fraction = kept T / T; informative_fraction = informative/N; kept_informative_fraction =
    kept informative rows / kept rows (1 when every slot carries policy gradient); eligible_fraction = |S|/N;
    zero_signal_ranks; j_ratio_ideal, j_ratio_achieved (means over ranks); batch_rows_generated / kept."""
    rows, kept = total["rows"], total["kept"]
    ranks = total["ranks"]
    return {
        "kept_row_fraction": total["draws"] / rows,
        "kept_token_fraction": total["kept_rollout_tokens"] / max(total["rollout_tokens"], 1.0),
        "kept_loss_token_fraction": total["kept_loss_tokens"] / max(total["loss_tokens"], 1.0),
        "informative_fraction": total["informative"] / rows,
        "kept_informative_fraction": total["kept_informative"] / max(kept, 1.0),
        "eligible_fraction": total["eligible"] / rows,
        "zero_signal_ranks": total["zero_signal_ranks"],
        "j_ratio_ideal": total["j_ideal"] / ranks,
        "j_ratio_achieved": total["j_achieved"] / ranks,
        "batch_rows_generated": rows,
        "batch_rows_kept": kept,
    }
