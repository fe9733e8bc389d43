"""Baselines of the token-efficiency benchmark: other rules for which rows of a GRPO generation batch to train on.

Each is a pure row-selection function (formula in the docstring) and a thin `CostAwareGRPOTrainer` subclass that
plugs it into the trainer's hook `_draw_kept_rows(batch) -> Plan(indices, factors)`: the trainer trains on the rows
`indices` with their advantages multiplied by `factors` (and runs the deferred log-prob passes on those rows only),
exactly as for the cost-aware draw, so every arm is counted (policy tokens, wall time) by the same code.

- `ZeroAdvantageFilterTrainer`: GRPO without the rows whose advantage is 0 (the groups whose rewards are all equal).
  With β = 0 and a token-sum loss normalised by the full batch's tokens (dapo), those rows add nothing to the
  gradient, so the update is *exactly* GRPO's at fewer policy tokens: the cheapest honest baseline.
- `MaxVarianceTrainer`: PODS max-variance down-sampling (Xu et al., 2025, "Not All Rollouts are Useful"): keep, in
  every group, the m rows whose rewards have the largest variance, recompute the group advantages on the kept rows,
  and train on them as plain GRPO (no importance weights; the loss is a mean over the kept tokens).

Single process only (the benchmark's setting); a multi-rank run is refused at construction. With
`steps_per_generation` > 1 the kept rows are split into that many micro-batches, so their count must be a multiple
of it: the filter pads with the cheapest zero-advantage rows (no gradient, so still exact), PODS keeps m rows of every
group and refuses a layout where that count is not a multiple.
"""

from __future__ import annotations

import torch

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.rows.plan import LOSS_NORMALISERS, Plan


# ==================================================================================================== pure rules
def zero_advantage_filter(
    advantages: torch.Tensor, multiple_of: int = 1, costs: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices of the rows with A_i ≠ 0, in order:  K = {i : A_i ≠ 0}, padded to a multiple of `multiple_of` rows
    with the cheapest rows of A_i = 0 (by `costs`, else the first ones): they add no gradient (β = 0), so the update
    is unchanged. When K is empty, `multiple_of` rows of A = 0 (the trainer needs at least one row per micro-batch)."""
    keep = (advantages != 0).nonzero().flatten()
    pad = (-len(keep)) % multiple_of if len(keep) else multiple_of
    if pad:
        zero = (advantages == 0).nonzero().flatten()
        if costs is not None:
            zero = zero[torch.sort(costs[zero].double(), stable=True).indices]
        keep = torch.sort(torch.cat([keep, zero[:pad]])).values
    return keep


def max_variance_subset(rewards: torch.Tensor, m: int) -> torch.Tensor:
    """Indices of the m rows of one group whose rewards have the largest variance (the PODS rule).

        K* = argmax_{|K| = m} Var({r_i : i ∈ K})

    The maximum is attained by the k highest and the m − k lowest rewards for some k (PODS, Lemma 1), so it is found
    by sorting and trying the m + 1 splits: O(G log G). Ties keep the lower index first."""
    g = len(rewards)
    if not 1 <= m <= g:
        raise ValueError(f"need 1 <= m <= group size {g}, got m={m}")
    order = torch.sort(rewards.double(), stable=True).indices  # ascending
    best, best_var = None, -1.0
    for k in range(m + 1):  # k from the top, m - k from the bottom
        idx = torch.cat([order[: m - k], order[g - k :]]) if k else order[:m]
        var = float(rewards.double()[idx].var(unbiased=False)) if m > 1 else 0.0
        if var > best_var + 1e-12:
            best, best_var = idx, var
    return torch.sort(best).values


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages of one group, as TRL computes them (scale_rewards="group"):  A_i = (r_i − r̄) / (std(r) + ε),
    std with Bessel's correction."""
    std = rewards.std() if len(rewards) > 1 else torch.zeros((), dtype=rewards.dtype)
    return (rewards - rewards.mean()) / (std + eps)


# ==================================================================================================== trainers
class _RowRuleTrainer(CostAwareGRPOTrainer):
    """Common part: run with cost_aware=True (so the hook is called), one process, and keep the counters."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.args.cost_aware:
            raise ValueError(
                f"{type(self).__name__} needs cost_aware=True (its row rule replaces the cost-aware draw)"
            )
        if self.accelerator.num_processes != 1:
            raise ValueError(f"{type(self).__name__} is a single-process benchmark baseline")

    def _bookkeeping(self, batch, kept: torch.Tensor) -> None:
        rows = self._host_row_stats(batch)
        n = len(rows["advantages"])
        self._add_generated(
            n, len(torch.unique(kept)), float(rows["rollout_lengths"].sum()), float(rows["generated_tokens"].sum())
        )
        metrics = self._metrics["train"]
        metrics["cost_aware/kept_row_fraction"].append(len(kept) / n)
        metrics["cost_aware/kept_token_fraction"].append(
            float(rows["rollout_lengths"][kept].sum() / rows["rollout_lengths"].sum())
        )

    def _full_over_kept_tokens(self, batch, kept: torch.Tensor) -> float:
        """T_full / T_kept for a token-sum loss (it divides by the full batch's tokens, `num_items_in_batch`: the
        loss types whose `plan.LOSS_NORMALISERS` entry has `batch_tokens`), else 1: makes the loss a mean over the
        kept tokens, as plain GRPO on the kept rows would be."""
        if not LOSS_NORMALISERS[self.loss_type].batch_tokens:
            return 1.0
        tokens = self._loss_mask(batch).sum(-1).float().cpu()
        return float(tokens.sum() / tokens[kept].sum().clamp(min=1))


class ZeroAdvantageFilterTrainer(_RowRuleTrainer):
    """GRPO on the rows with A ≠ 0 only; factors 1 (exactly GRPO's update under a full-batch token normaliser)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.beta != 0.0:
            raise ValueError("the zero-advantage filter is exact only with beta=0 (a KL term has gradient at A=0)")

    def _draw_kept_rows(self, batch):
        advantages = batch["advantages"].detach().float().cpu()
        costs = self._host_row_stats(batch)["rollout_lengths"]
        kept = zero_advantage_filter(advantages, self.args.steps_per_generation, costs)
        self._bookkeeping(batch, kept)
        return Plan(kept, torch.ones(len(kept)))


class MaxVarianceTrainer(_RowRuleTrainer):
    """PODS max-variance down-sampling at `cost_aware_kept_fraction` of each group's rows.

    Rewards are recovered from TRL's advantages up to a positive affine map per group (A_i = (r_i − r̄)/(s + ε)),
    which leaves both the max-variance subset and the re-normalised advantages of the subset unchanged (up to ε);
    the factor of a kept row is its new advantage over its old one (1 where the old one is 0)."""

    def _draw_kept_rows(self, batch):
        advantages = batch["advantages"].detach().double().cpu()
        g = self.num_generations
        m = max(1, round(self.args.cost_aware_kept_fraction * g))
        kept, factors = [], []
        for start in range(0, len(advantages), g):
            a = advantages[start : start + g]
            idx = max_variance_subset(a, m)
            new = group_advantages(a[idx]) if float(a.abs().max()) > 0 else torch.zeros(m, dtype=a.dtype)
            old = a[idx]
            factors.append(
                torch.where(old != 0, new / old.where(old != 0, torch.ones_like(old)), torch.ones_like(old))
            )
            kept.append(idx + start)
        kept = torch.cat(kept)
        spg = self.args.steps_per_generation
        if len(kept) % spg:
            raise ValueError(
                f"PODS keeps {m} rows of each of {len(advantages) // g} groups = {len(kept)} rows, not a multiple of "
                f"steps_per_generation={spg}: choose cost_aware_kept_fraction or the batch so that it is"
            )
        factors = torch.cat(factors).float() * self._full_over_kept_tokens(batch, kept)
        self._bookkeeping(batch, kept)
        return Plan(kept, factors)
