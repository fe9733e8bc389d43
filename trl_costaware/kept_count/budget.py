"""Adaptive per-batch budget: how many rows m to keep, chosen from a variance guarantee (docs/budget_and_proxy.md §2).

Notation as in `sampling.py`: a generation batch of N rows with gradient-norm proxies G_i (see `proxy.py`) and costs
c_i, a sampling distribution p, and inclusion probabilities π_i(m) = `inclusion_probabilities(p, m)` (Σ_i π_i = m).

The full batch's gradient (1/N) Σ_i g_i estimates the true gradient with sampling noise ≈ (1/N²) Σ_i G_i² (rows nearly
orthogonal, the usual case when noise dominates). Keeping m rows adds the Horvitz–Thompson variance
≈ (1/N²) Σ_i (1 − π_i)/π_i · G_i² (systematic draw, Poisson approximation) or (1/(m N²)) (Σ_i G_i²/p_i − Σ_i G_i²)
(multinomial draw, Hansen–Hurwitz). Their ratio, the variance inflation,

    I(m) = Σ_i (1 − π_i(m))/π_i(m) · G_i²  /  Σ_i G_i²              (systematic)
    I(m) = (Σ_i G_i²/p_i / Σ_i G_i² − 1) / m                        (multinomial)

is non-increasing in m (π_i(m) = min(1, λ(m) p_i) with λ increasing in m), is 0 at m = N for the systematic draw, and
ignores rows with G_i = 0 (they add no variance however rarely they are drawn). The budget rule keeps the smallest m
(a multiple of `multiple_of`) with I(m) ≤ δ, found by bisection. Example: k informative rows of equal G and cost,
α = 0, π = m/k on them: I = k/m − 1, so δ = 1 keeps k/2 rows and δ = 0.25 keeps 0.8k.

Since m is a function of the batch (its proxies and costs), not of the draw, the importance-weighted estimate stays
unbiased given m. Across ranks every rank must keep the same m; the plan (`plan.plan_batch`) takes the largest m any
rank needs, so every rank's inflation, hence the whole step's (a ratio of sums is at most the largest ratio), is ≤ δ.
The proxy passed in must be 0 on rows that cannot carry gradient (e.g. a row the truncation mask hides: |A| > 0 but no
loss token, and never drawn), or every m looks infinitely noisy.
"""

from __future__ import annotations

import math

import torch

from ..core.sampling import DRAW_SCHEMES, _clean, inclusion_probabilities

AUTO = "auto"
COMPUTE = "compute"  # the rule of `compute_budget.cheapest_kept_count`
RULES = (AUTO, COMPUTE)


class KeptFraction(float):
    """The type of a kept-fraction setting: a number in (0, 1], the string "auto" (the δ rule above) or "compute"
    (the cost-to-target rule of `compute_budget`).

    `KeptFraction("0.5")` returns the float 0.5 and `KeptFraction("auto")` the string "auto", so a dataclass field
    annotated with it parses from the command line and YAML (`HfArgumentParser` calls the annotation on the text).
    Anything else raises ValueError naming the allowed values; the range is checked by the config."""

    def __new__(cls, value):
        if isinstance(value, str) and value.strip().lower() in RULES:
            return value.strip().lower()
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"a kept fraction must be a number in (0, 1], {AUTO!r} or {COMPUTE!r}, got {value!r}"
            ) from None


def _left_out(pi: torch.Tensor) -> torch.Tensor:
    """1 − π, exactly 0 for π within rounding of 1 (π = m/k at m = k is not always 1.0 in floating point)."""
    return torch.where(pi >= 1.0 - 1e-12, torch.zeros_like(pi), 1.0 - pi)


def inflation_terms(g: torch.Tensor, p: torch.Tensor, m: int, scheme: str = "systematic") -> tuple[float, float]:
    """The numerator and denominator of I(m), in units of G² (so that sums over ranks give the step's inflation):

        systematic:   Σ_i (1 − π_i)/π_i · G_i²    and   Σ_i G_i²
        multinomial:  (Σ_i G_i²/p_i − Σ_i G_i²)/m  and   Σ_i G_i²

    A row with G_i > 0 that can never be drawn (p_i = 0) makes the numerator `math.inf`."""
    num, den, scale = _scaled_terms(g, p, m, scheme)
    return num * scale**2, den * scale**2


def _scaled_terms(g: torch.Tensor, p: torch.Tensor, m: int, scheme: str) -> tuple[float, float, float]:
    """(numerator, denominator) of I(m) computed with G / max G, and max G."""
    if scheme not in DRAW_SCHEMES:
        raise ValueError(f"draw scheme must be one of {DRAW_SCHEMES}, got {scheme!r}")
    g = _clean(g).double().abs()
    if g.numel() != p.numel():
        raise ValueError(f"g and p must have the same length, got {g.numel()} and {p.numel()}")
    scale = float(g.max()) if g.numel() else 0.0
    if scale <= 0:
        return 0.0, 0.0, 0.0
    g2 = (g / scale).pow(2)  # scale-free inside; keeps G² from under- or overflowing
    total, pos = g2.sum(), g2 > 0
    p = _clean(p).double().clamp(min=0.0)
    if scheme == "multinomial":
        if m <= 0:
            raise ValueError(f"m must be positive, got {m}")
        p = p / p.sum() if p.sum() > 0 else torch.full_like(p, 1.0 / p.numel())
        if bool((p[pos] <= 0).any()):
            return math.inf, float(total), scale
        num = max(0.0, float((g2[pos] / p[pos]).sum() - total) / m)
    else:
        pi = inclusion_probabilities(p, m)
        if bool((pi[pos] <= 0).any()):
            return math.inf, float(total), scale
        num = float((_left_out(pi[pos]) / pi[pos] * g2[pos]).sum())
    return num, float(total), scale


def variance_inflation(g: torch.Tensor, p: torch.Tensor, m: int, scheme: str = "systematic") -> float:
    """Predicted variance of the m-row importance-weighted estimate over the full batch's own noise, I(m) (module
    docstring). `g`: proxies G_i (N,); `p`: the sampling distribution (N,). All-zero G gives 0; a row with G_i > 0
    that can never be drawn (p_i = 0) gives `math.inf` (the estimate would be biased)."""
    num, den, _ = _scaled_terms(g, p, m, scheme)
    if den <= 0:
        return 0.0
    return math.inf if math.isinf(num) else num / den


def smallest_budget(
    g: torch.Tensor,
    p: torch.Tensor,
    delta: float,
    multiple_of: int = 1,
    scheme: str = "systematic",
) -> tuple[int, float]:
    """Smallest m, a multiple of `multiple_of` in [multiple_of, N], with I(m) ≤ δ; bisection on the monotone I.

    Returns (m, I(m)). N must be a multiple of `multiple_of`. For the systematic draw I(N) = 0, so m = N always
    satisfies the bound; for the multinomial draw m = N may not, and then N is returned with its I(N) > δ.
    """
    n = p.numel()
    if not delta >= 0 or not math.isfinite(delta):
        raise ValueError(f"delta must be a finite number >= 0, got {delta}")
    if multiple_of <= 0 or n % multiple_of:
        raise ValueError(f"N={n} must be a positive multiple of multiple_of={multiple_of}")
    lo, hi = 1, n // multiple_of  # in units of multiple_of; invariant: I(hi) ≤ δ or hi is the top
    i_hi = variance_inflation(g, p, hi * multiple_of, scheme)
    i_lo = variance_inflation(g, p, lo * multiple_of, scheme)
    if i_lo <= delta:
        return lo * multiple_of, i_lo
    while hi - lo > 1:  # I(lo) > δ
        mid = (lo + hi) // 2
        i_mid = variance_inflation(g, p, mid * multiple_of, scheme)
        if i_mid <= delta:
            hi, i_hi = mid, i_mid
        else:
            lo = mid
    return hi * multiple_of, i_hi
