"""The sampler's decision for one generation batch: one function of the rows' host statistics and the config.

`plan_batch(rows, settings, generator, collective) -> Plan` runs, in this order (docs/algorithm.md §2):

1. eligibility: the rows that can carry gradient, S (`sampling.eligible_rows`);
2. the sampling distribution p over S (`sampling.sampling_scores`, `sampling.sampling_distribution`);
3. m, equal on every rank: a fixed fraction (`sampling.kept_row_count`) or a token budget (the largest m whose
   expected kept cost Σ π_i(m) c_i fits it, `sampling.kept_rows_for_token_budget`), smallest over ranks, then capped
   at what the busiest rank's eligible rows need (`sampling.capped_kept_count`);
4. the systematic draw (`sampling.draw_systematic`); when this rank has fewer eligible rows than m, the remaining
   slots go, for sure, to the cheapest rows the loss sees: FILLER rows, which carry no policy gradient;
5. the weights: the draw's unbiasing weights of the kept non-filler rows of all ranks, normalised together
   (`sampling.normalize_weights`) around the design's expected mean weight w̄₀ of those slots
   (`sampling.design_weight_terms`, summed over ranks: |S|/N on one rank, not 1, since rows outside S are never
   drawn); filler rows get weight 0 and stay out of the mean, the centre, the floor and the weight metrics;
6. the per-row factor that multiplies each kept row's advantage: the weight times the loss type's correction from
   `LOSS_NORMALISERS`;
7. the metrics of the draw (`diagnostics`), summed over ranks.

Everything is on the host. The only cross-rank traffic goes through `collective` (three calls, none with one
process). The function reads nothing but its arguments and draws only from `generator`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch

from .diagnostics import batch_metrics, rank_sums
from .sampling import (
    Draw,
    capped_kept_count,
    design_weight_terms,
    draw_systematic,
    eligible_rows,
    kept_row_count,
    kept_rows_for_token_budget,
    normalize_weights,
    sampling_distribution,
    sampling_scores,
)


# ---------------------------------------------------------------------------------------------------- loss types
@dataclass(frozen=True)
class Normaliser:
    """How TRL 1.16's `GRPOTrainer._compute_loss` divides a loss type's masked per-token loss, and what that means for
    a sample of m of the N rows (docs/algorithm.md, "weights and normaliser per loss type").

    - `divisor`: TRL's normaliser, in words.
    - `row_length`: the divisor of row i contains its own token count L_i (the proxy's h_i = L_i^(γ−1), else L_i^γ).
    - `rows`: the loss is a mean over the micro-batch's rows, whose count shrinks with sampling by m/N: the factor is
      the weight w_i. Otherwise the divisor is fixed by the full generation batch and the factor is w_i · N/m.
    - `micro_tokens`: the divisor is the micro-batch's own token count, which sampling changes (bnpo): each kept
      micro-batch's factors are also multiplied by its tokens over the full batch's mean micro-batch tokens.
    - `batch_tokens`: the divisor is the full batch's token count (`num_items_in_batch`): the (unweighted) KL term
      would shrink with the kept tokens, so β is rescaled by T_full / T_kept.
    """

    divisor: str
    row_length: bool
    rows: bool
    micro_tokens: bool = False

    @property
    def batch_tokens(self) -> bool:
        return not self.rows and not self.micro_tokens


LOSS_NORMALISERS: dict[str, Normaliser] = {
    "grpo": Normaliser("mean over rows of the row's token mean", row_length=True, rows=True),
    "sapo": Normaliser("mean over rows of the row's token mean", row_length=True, rows=True),
    "dr_grpo": Normaliser("micro-batch rows × max_completion_length", row_length=False, rows=True),
    "luspo": Normaliser("mean over rows of the row's token sum", row_length=False, rows=True),
    "dapo": Normaliser("the generation batch's tokens (num_items_in_batch)", row_length=False, rows=False),
    "cispo": Normaliser("the generation batch's tokens (num_items_in_batch)", row_length=False, rows=False),
    "vespo": Normaliser("the generation batch's tokens (num_items_in_batch)", row_length=False, rows=False),
    "bnpo": Normaliser("the micro-batch's own tokens", row_length=False, rows=False, micro_tokens=True),
}


def check_loss_type(loss_type) -> Normaliser:
    """The normaliser of `loss_type`; a ValueError naming the field and the allowed values for any other name (a loss
    type TRL adds later must be derived and added to `LOSS_NORMALISERS` before cost-aware sampling can weight it)."""
    if loss_type not in LOSS_NORMALISERS:
        raise ValueError(
            f"loss_type={loss_type!r} is not supported with cost_aware=True: the kept rows' weights depend on the "
            f"loss type's normaliser, derived for {tuple(LOSS_NORMALISERS)}. Use one of them, or cost_aware=False."
        )
    return LOSS_NORMALISERS[loss_type]


# ---------------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of this rank's generation batch, host tensors of shape (N,).

    advantages A_i; costs c_i (the sampling cost); loss_tokens T_i (tokens the loss sees: completion × tool mask,
    after `mask_truncated_completions`); proxy_factors h_i (ones unless the "loss_aware" proxy); rollout_lengths
    (prompt + generated tokens, whatever the masks); generated_tokens; prompt_tokens and completion_tokens (the
    attention masks' row sums: what a forward pass over the row costs)."""

    advantages: torch.Tensor
    costs: torch.Tensor
    loss_tokens: torch.Tensor
    proxy_factors: torch.Tensor
    rollout_lengths: torch.Tensor
    generated_tokens: torch.Tensor
    prompt_tokens: torch.Tensor
    completion_tokens: torch.Tensor

    def __getitem__(self, key: str) -> torch.Tensor:
        return getattr(self, key)

    def __len__(self) -> int:
        return len(self.advantages)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class PlanSettings:
    """The configuration fields the plan reads (`from_args` takes them from a `CostAwareGRPOConfig`)."""

    loss_type: str = "grpo"
    kept_fraction: float = 0.5
    token_budget: float | None = None  # if set, replaces kept_fraction
    proxy: str = "loss_aware"
    smoothing: float = 0.1
    weight_normalization: str = "none"
    steps_per_generation: int = 1
    zero_advantage_carries_gradient: bool = False
    kept_multiple: int = 1  # what m is rounded to (`layout.kept_multiple`)

    def __post_init__(self):
        check_loss_type(self.loss_type)

    @classmethod
    def from_args(cls, args, zero_advantage_carries_gradient: bool, kept_multiple: int) -> PlanSettings:
        return cls(
            loss_type=args.loss_type,
            kept_fraction=args.cost_aware_kept_fraction,
            token_budget=args.cost_aware_token_budget,
            proxy=args.cost_aware_proxy,
            smoothing=args.cost_aware_smoothing,
            weight_normalization=args.cost_aware_weight_normalization,
            steps_per_generation=args.steps_per_generation,
            zero_advantage_carries_gradient=zero_advantage_carries_gradient,
            kept_multiple=kept_multiple,
        )


class Collective(Protocol):
    """The cross-rank operations the plan needs; every rank calls them in the same order with the same shapes."""

    rank: int
    size: int

    def max_ints(self, values: list[int]) -> list[int]:
        """Elementwise maximum over ranks."""

    def cat(self, x: torch.Tensor) -> torch.Tensor:
        """Host tensor of every rank's `x` concatenated along dim 0, in rank order."""

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sums over ranks of named scalars."""


class SingleProcess:
    """The collective of one process: identities, no device round trip."""

    rank, size = 0, 1

    def max_ints(self, values):
        return list(values)

    def cat(self, x):
        return x

    def sum(self, values):
        return {k: float(v) for k, v in values.items()}


def float64_bits(x: torch.Tensor) -> torch.Tensor:
    """A float64 host tensor as its int64 bit pattern (`to_float64` reads it back bit for bit). Collectives send
    float64 values this way: every backend gathers int64, and not every device has float64 (MPS has none)."""
    return x.double().contiguous().view(torch.int64)


def to_float64(bits: torch.Tensor) -> torch.Tensor:
    """The float64 host tensor whose int64 bit pattern is `bits` (`float64_bits`)."""
    return bits.cpu().contiguous().view(torch.float64)


class AcceleratorCollective:
    """`Collective` over the accelerator's processes (gathers on the batch's device, one host copy each). Nothing
    float64 reaches the device: float64 values travel as their int64 bit pattern (`float64_bits`) and are read and
    summed on the host, so the results are float64 exactly as if the device had it."""

    def __init__(self, accelerator, device):
        self.accelerator, self.device = accelerator, device
        self.rank, self.size = accelerator.process_index, accelerator.num_processes

    def max_ints(self, values):
        local = torch.tensor([[int(v) for v in values]], dtype=torch.int64, device=self.device)
        return self.accelerator.gather(local).amax(0).cpu().tolist()

    def cat(self, x):
        return to_float64(self.accelerator.gather(float64_bits(x).to(self.device)))

    def sum(self, values):
        local = float64_bits(torch.tensor([list(values.values())], dtype=torch.float64))
        total = to_float64(self.accelerator.gather(local.to(self.device))).sum(0).tolist()
        return dict(zip(values, total, strict=True))


# ---------------------------------------------------------------------------------------------------- output
@dataclass
class Plan:
    """What the trainer applies to its generation batch (`CostAwareGRPOTrainer._draw_kept_rows` returns it).

    `indices` (m,) the kept rows; `factors` (m,) float64, the multiplier of each kept row's advantage. A row rule of
    its own (a subclass's `_draw_kept_rows`) may give only these two: the plan-only corrections then do not apply and
    the trainer counts the kept tokens itself. `rows` the batch's host statistics; `kept_stats` (derived from `rows`
    and `indices`) the kept rows' prompt, completion and loss tokens; `filler` (m,) the kept slots outside the support
    (factor 0); `p` the sampling distribution, `eligible` the support, `draw` the draw (`draw.probabilities`: π).
    `global_weights` (ranks·m,) every rank's normalised slot weights (fillers 0), `global_filler` their flags.
    `kl_scale` the β multiplier of a batch-token loss (None otherwise; > 0, 1 when the kept rows have no loss token);
    `micro_tokens_full` bnpo's full-batch mean micro-batch loss tokens (None otherwise, or when this rank's batch has
    no loss token). `totals` the counters summed over ranks; `metrics` the logged values (no "cost_aware/" prefix)."""

    indices: torch.Tensor
    factors: torch.Tensor
    rows: RowStats | None = None
    filler: torch.Tensor | None = None
    m: int | None = None
    p: torch.Tensor | None = None
    eligible: torch.Tensor | None = None
    draw: Draw | None = None
    global_weights: torch.Tensor | None = None
    global_filler: torch.Tensor | None = None
    kl_scale: float | None = None
    micro_tokens_full: float | None = None
    totals: dict[str, float] | None = None
    metrics: dict[str, float] | None = None

    @property
    def kept_stats(self) -> dict[str, torch.Tensor] | None:
        keys = ("prompt_tokens", "completion_tokens", "loss_tokens")
        return None if self.rows is None else {k: self.rows[k][self.indices] for k in keys}


def filler_scores(rows: RowStats) -> torch.Tensor:
    """Filler scores (`inclusion_probabilities`): 1/c_i, cheapest rows the loss sees first, 0 with no loss token."""
    return (rows.loss_tokens > 0).double() / rows.costs.double().clamp(min=1.0)


def drawn_distribution(p: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """p on the support S, 0 outside it even when S is empty (p is then uniform, for the metrics only)."""
    return torch.where(eligible.to(p.device), p, torch.zeros_like(p))


def token_budget_count(rows: RowStats, p: torch.Tensor, eligible: torch.Tensor, budget: float) -> int:
    """This rank's own m under a token budget, before the reduction over ranks (`kept_rows_for_token_budget`)."""
    q = drawn_distribution(p, eligible)
    return kept_rows_for_token_budget(q, rows.costs, budget, len(rows), filler_scores(rows))


def _kept_count(rows: RowStats, s: PlanSettings, p, eligible, collective: Collective) -> int:
    """m: this rank's count from the fraction or the token budget, reduced to the smallest over ranks together with
    the eligible rows of the busiest rank (one call), then capped at what those rows need."""
    n, unit = len(rows), s.kept_multiple
    if s.token_budget is not None:
        m_local = token_budget_count(rows, p, eligible, s.token_budget)
    else:
        m_local = kept_row_count(n, s.kept_fraction, unit)
    negative_m, k_max = collective.max_ints([-m_local, int(eligible.sum())])
    return capped_kept_count(kept_row_count(n, -negative_m / n, unit), k_max, unit)


def plan_batch(
    rows: RowStats,
    settings: PlanSettings,
    generator: torch.Generator | None = None,
    collective: Collective | None = None,
) -> Plan:
    """The plan of one generation batch (module docstring). Every rank must call it with the same `settings`."""
    s, collective = settings, collective or SingleProcess()
    normaliser = check_loss_type(s.loss_type)
    n = len(rows)
    advantages, costs, loss_tokens = rows.advantages, rows.costs, rows.loss_tokens

    eligible = eligible_rows(advantages, loss_tokens, s.zero_advantage_carries_gradient)
    scores = sampling_scores(advantages, costs, s.proxy, rows.proxy_factors)
    p = sampling_distribution(scores, s.smoothing, support=eligible)
    m = _kept_count(rows, s, p, eligible, collective)
    draw = draw_systematic(drawn_distribution(p, eligible), m, generator, filler=filler_scores(rows))
    filler = ~eligible[draw.indices]

    # Normalise over the kept non-filler slots of all ranks (every rank has m slots, so the concatenation is even),
    # centred at the design's expected mean weight w̄₀: each slot also carries 1/m of its rank's two design sums.
    expected_sum, slots = design_weight_terms(draw.probabilities, eligible, m)
    design = torch.tensor([expected_sum / m, slots / m], dtype=torch.float64).expand(m, 2)
    both = collective.cat(torch.cat([torch.stack([draw.weights.double(), filler.double()], dim=1), design], dim=1))
    all_weights, all_filler = both[:, 0], both[:, 1] > 0
    total_slots = float(both[:, 3].sum())
    center = float(both[:, 2].sum()) / total_slots if total_slots > 0 else 1.0
    normalised, stats = normalize_weights(all_weights[~all_filler], s.weight_normalization, center=center)
    global_weights = torch.zeros_like(all_weights)
    global_weights[~all_filler] = normalised
    factors = global_weights[collective.rank * m : (collective.rank + 1) * m].clone()
    if not normaliser.rows:
        factors = factors * (n / m)

    full_tokens = float(loss_tokens.sum())
    kept_tokens = float(loss_tokens[draw.indices].sum())
    # Exact factors when the kept rows have no loss token (their loss and KL term are 0 whatever the factor): β keeps
    # its value (KL scale 1, never 0: TRL's `if self.beta != 0.0` branch holds collectives, so β must not become 0 on
    # one rank only), and bnpo's micro-batches keep factor 1 (no correction: micro_tokens_full None).
    kl_scale = (full_tokens / kept_tokens if kept_tokens > 0 else 1.0) if normaliser.batch_tokens else None
    micro_tokens_full = full_tokens / s.steps_per_generation if normaliser.micro_tokens and full_tokens > 0 else None

    local = rank_sums(
        advantages,
        costs,
        eligible,
        p,
        draw.indices,
        rows.rollout_lengths,
        rows.generated_tokens,
        loss_tokens,
        m,
    )
    local["fillers"] = float(filler.sum())
    local["policy_tokens"] = float((rows.prompt_tokens + rows.completion_tokens)[draw.indices].sum())
    total = collective.sum(local)

    metrics = batch_metrics(total)
    metrics["filler_row_fraction"] = total["fillers"] / total["draws"]
    metrics.update(stats.as_dict(prefix="weight_"))
    metrics["weight_center"] = center
    totals = {k: total[k] for k in ("rows", "kept", "rollout_tokens", "generated_tokens", "policy_tokens")}
    return Plan(
        indices=draw.indices,
        factors=factors,
        rows=rows,
        filler=filler,
        m=m,
        p=p,
        eligible=eligible,
        draw=draw,
        global_weights=global_weights,
        global_filler=all_filler,
        kl_scale=kl_scale,
        micro_tokens_full=micro_tokens_full,
        totals=totals,
        metrics=metrics,
    )
