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
unbiased given m. Across ranks every rank must keep the same m; `budget_over_ranks` takes the largest m any rank
needs, so every rank's inflation, hence the whole step's (a ratio of sums is at most the largest ratio), is ≤ δ.

A second rule trades the two costs of a step (ALGORITHM.md §5): in the noise-dominated regime the steps to a target
grow like the update's variance, V_N (1 + I(m)), and each step costs C_gen + C_upd(m), with C_upd(m) = Σ_i π_i(m) c_i
the expected policy-update tokens and C_gen the generation and scoring cost of the batch in the same units. Keeping

    m* = argmin_m (1 + I(m)) · (C_gen + C_upd(m))

minimises the predicted cost to the target (`cost_trading_budget`).
"""

from __future__ import annotations

import math

import torch

from .sampling import DRAW_SCHEMES, inclusion_probabilities


def _clean(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x.double(), nan=0.0, posinf=0.0, neginf=0.0)


def variance_inflation(g: torch.Tensor, p: torch.Tensor, m: int, scheme: str = "systematic") -> float:
    """Predicted variance of the m-row importance-weighted estimate over the full batch's own noise, I(m) (module
    docstring). `g`: proxies G_i (N,); `p`: the sampling distribution (N,). All-zero G gives 0; a row with G_i > 0
    that can never be drawn (p_i = 0) gives `math.inf` (the estimate would be biased)."""
    if scheme not in DRAW_SCHEMES:
        raise ValueError(f"draw scheme must be one of {DRAW_SCHEMES}, got {scheme!r}")
    g2 = _clean(g).abs().pow(2)
    if g2.numel() != p.numel():
        raise ValueError(f"g and p must have the same length, got {g2.numel()} and {p.numel()}")
    total = g2.sum()
    if total <= 0:
        return 0.0
    g2 = g2 / g2.max()  # scale-free; keeps G² from under- or overflowing
    total = g2.sum()
    pos = g2 > 0
    p = _clean(p).clamp(min=0.0)
    if scheme == "multinomial":
        if m <= 0:
            raise ValueError(f"m must be positive, got {m}")
        p = p / p.sum() if p.sum() > 0 else torch.full_like(p, 1.0 / p.numel())
        if bool((p[pos] <= 0).any()):
            return math.inf
        return max(0.0, float(((g2[pos] / p[pos]).sum() / total - 1.0) / m))
    pi = inclusion_probabilities(p, m)
    if bool((pi[pos] <= 0).any()):
        return math.inf
    return float(((1.0 - pi[pos]) / pi[pos] * g2[pos]).sum() / total)


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


def cost_trading_budget(
    g: torch.Tensor,
    p: torch.Tensor,
    costs: torch.Tensor,
    generation_cost: float,
    multiple_of: int = 1,
    scheme: str = "systematic",
) -> tuple[int, float]:
    """m* = argmin_m (1 + I(m)) · (C_gen + C_upd(m)) over the multiples of `multiple_of` (module docstring).

    C_upd(m) = Σ_i π_i(m) c_i (systematic) or m Σ_i p_i c_i (multinomial), in the units of `costs`;
    `generation_cost` (C_gen ≥ 0) is the cost of generating and scoring the whole batch in the same units (e.g.
    tokens × the ratio of a generated token's cost to a trained token's). Returns (m*, I(m*)); ties go to the
    smallest m. All-zero G returns the smallest m.
    """
    n = p.numel()
    if generation_cost < 0 or not math.isfinite(generation_cost):
        raise ValueError(f"generation_cost must be a finite number >= 0, got {generation_cost}")
    if multiple_of <= 0 or n % multiple_of:
        raise ValueError(f"N={n} must be a positive multiple of multiple_of={multiple_of}")
    c = _clean(costs).clamp(min=0.0)
    best = (math.inf, multiple_of, 0.0)
    for m in range(multiple_of, n + 1, multiple_of):
        inflation = variance_inflation(g, p, m, scheme)
        if scheme == "multinomial":
            upd = m * float((p.double() / p.double().sum() * c).sum())
        else:
            upd = float((inclusion_probabilities(p, m) * c).sum())
        total = (1.0 + inflation) * (generation_cost + upd)
        if total < best[0]:
            best = (total, m, inflation)
    return best[1], best[2]


def budget_over_ranks(m_per_rank: torch.Tensor) -> int:
    """The m every rank keeps: the largest m any rank needs (each rank's I ≤ δ, so the step's I ≤ δ too)."""
    if m_per_rank.numel() == 0:
        raise ValueError("need the budget of at least one rank")
    return int(m_per_rank.max())
