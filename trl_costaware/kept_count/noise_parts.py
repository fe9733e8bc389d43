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
) -> NoiseParts:
    """The noise terms of one batch from its two prompt halves (g_A, g_B) and its two rollout halves (g_1, g_2):
    total = |g_A − g_B|²/4, within = |g_1 − g_2|²/4, signal = g_A · g_B (module docstring), each |·| in the geometry of
    `weight` when given. Single-batch estimates are noisy (between and signal can come out negative); average them
    over batches with `mean_parts` before taking ratios."""
    g_a, g_b = prompt_halves
    g_1, g_2 = rollout_halves
    return NoiseParts(
        total=_sq(g_a - g_b, weight) / 4.0,
        within=_sq(g_1 - g_2, weight) / 4.0,
        signal=_dot(g_a, g_b, weight),
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
