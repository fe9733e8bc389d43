"""The gradient noise of a generation batch split into its between-prompt and within-group parts, from four
half-batch gradients (pure torch; issue 39's candidate response model, docs/budget_and_proxy.md §3).

Setting. A batch holds K prompts and G rollouts of each; its gradient is g = (1/(K G)) Σ_j Σ_r x_jr. Model the prompts
as independent draws whose mean gradients μ_j have covariance Σ_b around the true gradient 𝐆, and the rollouts of a
prompt as exchangeable around μ_j with covariance Σ_w. Then

    tr Var(g) = tr Σ_b / K  +  tr Σ_w / (K G)          (between prompts  +  within groups)

Two ways of halving the batch give two independent estimates:

- by prompts (g_A, g_B: each from K/2 of the prompts with all their rollouts): Var(g_A − g_B) = 4 Var(g), so
      total  = |g_A − g_B|² / 4                 is unbiased for tr Var(g);
- by rollouts (g_1, g_2: each from G/2 rollouts of every prompt): the prompt means cancel, Var(g_1 − g_2) =
  4 tr Σ_w / (K G), so
      within = |g_1 − g_2|² / 4                 is unbiased for the within-group part;
- between = total − within, and the signal |𝐆|² = E[g_A · g_B] (two independent halves).

With GRPO's group advantages the rollouts of a group share their group's mean and scale, so they are exchangeable but
not independent; the rollout split then measures the within-group spread that a different draw of rollouts (or of
kept rows) would change, which is the part a row sample adds to.

What the parts predict (McCandlish et al. 2018, arXiv 1812.06162: steps to a target ∝ 1 + B_noise / B at a tuned
learning rate; ρ = B_noise / B = total / signal at the full batch). Generating for a fraction φ of the prompts
divides the batch by 1/φ: both parts grow by 1/φ. Training on a row sample with variance inflation I
(`budget.variance_inflation`, which prices the rows as independent) adds I times the within-group part only, since
which prompts were drawn is not changed by which of their rows are kept:

    steps(φ, I) / steps(1, 0) = (1 + (between + (1 + I) within) / (φ signal)) / (1 + ρ).

`weight` (optional, the parameters' shape flattened like the gradients) puts every norm in a preconditioned geometry:
|w ⊙ x|², e.g. w = 1/(√v̂ + ε) from Adam's second moment (the McCandlish et al. appendix on preconditioned updates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NoiseParts:
    """One batch's (or an average of batches') noise terms, in squared-gradient units."""

    total: float  # tr Var(g) of the full batch
    within: float  # its within-group part, tr Σ_w / (K G)
    signal: float  # |𝐆|²

    @property
    def between(self) -> float:
        return self.total - self.within

    @property
    def rho(self) -> float:
        """B_noise / B at the full batch: total / signal (∞ when the signal is not positive)."""
        return self.total / self.signal if self.signal > 0 else math.inf

    @property
    def within_share(self) -> float:
        """within / total (nan when there is no noise)."""
        return self.within / self.total if self.total > 0 else math.nan


def _sq(x: torch.Tensor, weight: torch.Tensor | None) -> float:
    x = x.double()
    if weight is not None:
        x = x * weight.double()
    return float(x.pow(2).sum())


def _dot(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None) -> float:
    x, y = x.double(), y.double()
    if weight is not None:
        w = weight.double()
        x, y = x * w, y * w
    return float((x * y).sum())


def noise_parts(
    prompt_halves: tuple[torch.Tensor, torch.Tensor],
    rollout_halves: tuple[torch.Tensor, torch.Tensor],
    weight: torch.Tensor | None = None,
    prompt_share: float = 0.5,
    rollout_share: float = 0.5,
) -> NoiseParts:
    """The noise terms of one batch from its two prompt halves (g_A, g_B) and its two rollout halves (g_1, g_2), each
    the mean gradient of its rows: total = a(1 − a)|g_A − g_B|², within = b(1 − b)|g_1 − g_2|², signal = g_A · g_B,
    with a the share of the prompts in A and b the share of each prompt's rollouts in half 1 (1/2 and 1/2:
    |g_A − g_B|²/4 and |g_1 − g_2|²/4, module docstring; unequal halves, e.g. an odd number of prompts or rollouts:
    Var(g_A − g_B) = tr Var(g) (1/a + 1/(1 − a))), each |·| in the geometry of `weight` when given. Single-batch
    estimates are noisy (between and signal can come out negative); average them over batches with `mean_parts`
    before taking ratios."""
    for name, share in (("prompt_share", prompt_share), ("rollout_share", rollout_share)):
        if not 0.0 < share < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {share!r}")
    g_a, g_b = prompt_halves
    g_1, g_2 = rollout_halves
    a, b = prompt_share, rollout_share
    return NoiseParts(
        total=a * (1 - a) * _sq(g_a - g_b, weight),
        within=b * (1 - b) * _sq(g_1 - g_2, weight),
        signal=_dot(g_a, g_b, weight),
    )


def quarter_labels(groups: int, generations: int, generator: torch.Generator) -> tuple[torch.Tensor, float, float]:
    """A random split of a batch of `groups` groups of `generations` consecutive rows (row j·G + r is rollout r of
    prompt j) into the four quarters of `noise_parts`: each row's label 2·h + s, h ∈ {0, 1} its prompt half (A: ⌊K/2⌋
    of the prompts, drawn uniformly) and s ∈ {0, 1} its rollout half (half 1: ⌊G/2⌋ of each prompt's rollouts, drawn
    uniformly per prompt). Returns (labels (K·G,), a, b) with a = ⌊K/2⌋/K and b = ⌊G/2⌋/G the shares of prompt half A
    and rollout half 1. Needs K ≥ 2 and G ≥ 2."""
    if groups < 2 or generations < 2:
        raise ValueError(f"a split into halves needs >= 2 groups and >= 2 rollouts each, got {groups}, {generations}")
    k_a, g_1 = groups // 2, generations // 2
    prompt_half = torch.ones(groups, dtype=torch.long)
    prompt_half[torch.randperm(groups, generator=generator)[:k_a]] = 0
    rollout_half = torch.ones(groups, generations, dtype=torch.long)
    for j in range(groups):
        rollout_half[j, torch.randperm(generations, generator=generator)[:g_1]] = 0
    labels = (2 * prompt_half[:, None] + rollout_half).reshape(-1)
    return labels, k_a / groups, g_1 / generations


def parts_from_sums(
    ha_sq: float, hb_sq: float, ha_hb: float, r_sq: float, prompt_share: float, rollout_share: float, rows: int
) -> NoiseParts:
    """`noise_parts` from four scalars of the quarters' gradient SUMS Q_q (labels of `quarter_labels`: 0 = (A, 1),
    1 = (A, 2), 2 = (B, 1), 3 = (B, 2); each Q_q the sum of its rows' gradients, N = `rows` rows in all), so that a
    caller accumulating H_A = Q_0 + Q_1, H_B = Q_2 + Q_3 and R = (Q_0 + Q_2)/b − (Q_1 + Q_3)/(1 − b) never holds more
    than three gradient-sized buffers. With g_A = H_A/(aN), g_B = H_B/((1 − a)N) and g_1 − g_2 = R/N:

        total  = a(1 − a) (|H_A|²/a² + |H_B|²/(1 − a)² − 2 H_A·H_B/(a(1 − a))) / N²,
        within = b(1 − b) |R|² / N²,      signal = H_A·H_B / (a(1 − a) N²).

    `ha_sq` = |H_A|², `hb_sq` = |H_B|², `ha_hb` = H_A·H_B, `r_sq` = |R|²."""
    a, b = prompt_share, rollout_share
    for name, share in (("prompt_share", a), ("rollout_share", b)):
        if not 0.0 < share < 1.0:
            raise ValueError(f"{name} must be in (0, 1), got {share!r}")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    n2 = float(rows) ** 2
    difference = ha_sq / a**2 + hb_sq / (1 - a) ** 2 - 2.0 * ha_hb / (a * (1 - a))
    return NoiseParts(
        total=a * (1 - a) * max(difference, 0.0) / n2,
        within=b * (1 - b) * r_sq / n2,
        signal=ha_hb / (a * (1 - a) * n2),
    )


def mean_parts(parts: list[NoiseParts]) -> NoiseParts:
    """The average of several batches' terms (each averaged on its own: a ratio of means, not a mean of ratios)."""
    if not parts:
        raise ValueError("mean_parts needs at least one batch")
    n = len(parts)
    return NoiseParts(
        total=sum(p.total for p in parts) / n,
        within=sum(p.within for p in parts) / n,
        signal=sum(p.signal for p in parts) / n,
    )


def predicted_steps_ratio(parts: NoiseParts, prompt_fraction: float = 1.0, inflation: float = 0.0) -> float:
    """Steps to a target at a fraction φ of the prompts and a row sample of variance inflation I, over the full
    batch's: (1 + (between + (1 + I) within) / (φ signal)) / (1 + ρ). ∞ when the signal is not positive; a negative
    between part (noise of the estimate) is taken as 0."""
    if not 0.0 < prompt_fraction <= 1.0:
        raise ValueError(f"prompt_fraction must be in (0, 1], got {prompt_fraction!r}")
    if inflation < 0.0:
        raise ValueError(f"inflation must be >= 0, got {inflation!r}")
    if not parts.signal > 0:
        return math.inf
    within = max(parts.within, 0.0)
    between = max(parts.total - within, 0.0)
    full = 1.0 + (between + within) / parts.signal
    return (1.0 + (between + (1.0 + inflation) * within) / (prompt_fraction * parts.signal)) / full
