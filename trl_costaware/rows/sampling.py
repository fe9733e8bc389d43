"""The cost-aware sampling core: pure torch, no trainer in sight.

Notation (docs/algorithm.md). A generation batch holds N rollouts; rollout i has a gradient-norm proxy
g_i = |A_i| (its advantage) and a cost c_i (tokens). We keep m < N rows for the policy update, drawn from a
distribution p, and weight each kept row so that

    (1/m) Σ_kept w_i L_i   is unbiased for   (1/N) Σ_all L_i.

Every function here is deterministic given its inputs and the `torch.Generator` the caller passes in; none
reads global RNG state, and none returns NaN or infinity for any finite-or-NaN input.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

PROXIES = ("advantage", "loss_aware", "uniform")
COST_KINDS = ("prompt_completion", "completion")
WEIGHT_NORMALIZATIONS = ("none", "recenter")

# Costs are clamped to at least one token: an empty completion still costs a forward position, and a zero cost
# would make g/√c infinite.
MIN_COST = 1.0


def stream_seed(seed: int, rank: int, stream: str) -> int:
    """A 63-bit seed for random stream `stream` of process `rank`: the first 8 bytes of SHA-256("seed/rank/stream").

    Streams of different names or ranks are independent for any integer seed (an offset scheme such as
    seed·K + rank + j makes stream j of rank r the stream 0 of rank r + j)."""
    digest = hashlib.sha256(f"trl-costaware/{int(seed)}/{int(rank)}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def stream_generator(seed: int, rank: int, stream: str) -> torch.Generator:
    """A host `torch.Generator` seeded with `stream_seed(seed, rank, stream)`."""
    return torch.Generator().manual_seed(stream_seed(seed, rank, stream))


def sequence_costs(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, kind: str = "prompt_completion"):
    """Per-row cost in tokens, from attention masks.

    c_i = Σ_t prompt_mask[i, t] + Σ_t completion_mask[i, t]   (kind="prompt_completion")
    c_i = Σ_t completion_mask[i, t]                           (kind="completion")

    clamped to `MIN_COST` (1 token) so that c_i > 0 always. Returns a float tensor of shape (N,).
    """
    if kind not in COST_KINDS:
        raise ValueError(f"cost kind must be one of {COST_KINDS}, got {kind!r}")
    costs = completion_mask.sum(-1).float()
    if kind == "prompt_completion":
        costs = costs + prompt_mask.sum(-1).float()
    return costs.clamp(min=MIN_COST)


def _clean(x: torch.Tensor) -> torch.Tensor:
    """Non-finite entries → 0; float64 stays float64 (tiny probabilities must not round to 0)."""
    x = x if x.dtype == torch.float64 else x.float()
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


# An infinite cost must make a row expensive, not (after cleaning to 0 and clamping to MIN_COST) the cheapest.
_HUGE_COST = 1e30


def _clean_costs(costs: torch.Tensor) -> torch.Tensor:
    costs = costs if costs.dtype == torch.float64 else costs.float()
    return torch.nan_to_num(costs, nan=MIN_COST, posinf=_HUGE_COST, neginf=MIN_COST).clamp(min=MIN_COST)


def gradient_proxy(advantages: torch.Tensor, row_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient-norm proxy G_i = |A_i| (the paper's), or G_i = |A_i| · h_i with the loss type's per-row factor h_i
    (`proxy.row_factor`, the "loss_aware" proxy) when `row_factors` is given. NaN advantages give G_i = 0; a product
    that overflows is held at the dtype's largest finite value (never inf)."""
    g = _clean(advantages).abs()
    if row_factors is None:
        return g
    return (g * _clean(row_factors).abs().to(g.dtype)).clamp(max=torch.finfo(g.dtype).max)


def sampling_scores(
    advantages: torch.Tensor,
    costs: torch.Tensor,
    proxy: str = "advantage",
    row_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unnormalised sampling scores s_i (the distribution is q_i = s_i / Σ_j s_j).

    - "advantage":          s_i = |A_i| / √c_i        (the method: p* ∝ G_i/√c_i with G_i ≈ |A_i|)
    - "loss_aware":         s_i = |A_i| · h_i / √c_i  (G_i ≈ |A_i| h_i, h_i = `row_factors` from `proxy.row_factor`:
                                                       the loss type's normaliser and the row's length; needs them)
    - "uniform":            s_i = 1                   (plain subsampling of the support, the arm to compare against)

    Rows with A_i = 0 (or NaN) get s_i = 0 under "advantage" and "loss_aware": they carry no policy gradient.
    """
    if proxy not in PROXIES:
        raise ValueError(f"proxy must be one of {PROXIES}, got {proxy!r}")
    costs = _clean_costs(costs)
    if proxy == "loss_aware":
        if row_factors is None:
            raise ValueError('proxy "loss_aware" needs the per-row factors h_i (row_factors)')
        return gradient_proxy(advantages, row_factors) / costs.sqrt()
    if proxy == "advantage":
        return gradient_proxy(advantages) / costs.sqrt()
    return torch.ones_like(costs)


def eligible_rows(
    advantages: torch.Tensor, loss_tokens: torch.Tensor, zero_advantage_carries_gradient: bool
) -> torch.Tensor:
    """Rows that can carry gradient, the support S of the sampling distribution:

        i ∈ S  ⇔  T_i > 0  ∧  (A_i ≠ 0  ∨  zero_advantage_carries_gradient)

    with T_i the tokens the loss sees (completion mask × tool mask, after TRL's `mask_truncated_completions`). A row
    with T_i = 0 adds nothing to any loss term. A row with A_i = 0 (or NaN) adds nothing to the policy term; it still
    carries gradient when the loss has a term that is not proportional to A (KL with β ≠ 0, an entropy bonus, a router
    aux loss): the caller says so. Returns a bool tensor of shape (N,).
    """
    has_tokens = _clean(loss_tokens) > 0
    if zero_advantage_carries_gradient:
        return has_tokens
    return has_tokens & (gradient_proxy(advantages) > 0)


def sampling_distribution(
    scores: torch.Tensor, alpha: float = 0.0, support: torch.Tensor | None = None
) -> torch.Tensor:
    """Smoothed sampling distribution over a support S (all rows when `support` is None):

        p_i = (1 − α) q_i + α u_i   for i ∈ S,   p_i = 0 outside S,

    with q_i = s_i / Σ_{j∈S} s_j and u_i = 1/|S| (smoothing spreads over the rows that can carry gradient only, so no
    probability goes to a row that adds nothing to the loss). Degenerate inputs: NaN, infinite or negative scores count
    as 0; if every score on S is 0, q is uniform on S; if S is empty, p is uniform over all rows (nothing in the batch
    carries gradient, any draw is as good). The result is a float64 probability vector: p_i ≥ 0, Σ p_i = 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    s = _clean(scores).double().clamp(min=0.0)
    n = s.numel()
    if n == 0:
        raise ValueError("cannot build a sampling distribution over zero rows")
    inside = torch.ones(n, dtype=torch.bool) if support is None else support.to(torch.bool).cpu()
    inside = inside.to(s.device)
    if not inside.any():  # nothing carries gradient: any draw is as good, take the uniform one
        inside, s = torch.ones_like(inside), torch.zeros_like(s)
    s = torch.where(inside, s, torch.zeros_like(s))
    if s.max() > 0:
        s = s / s.max()  # scale-free; keeps Σ s from overflowing (scores near the dtype's largest value)
    uniform = inside.double() / int(inside.sum())
    total = s.sum()
    q = s / total if total > 0 else uniform
    p = (1.0 - alpha) * q + alpha * uniform
    return p / p.sum()


def inclusion_probabilities(p: torch.Tensor, m: int, filler: torch.Tensor | None = None) -> torch.Tensor:
    """First-order inclusion probabilities for a fixed-size draw of m rows without replacement.

    π_i = min(1, m p_i), with the mass cut off at 1 re-spread over the uncapped rows in proportion to p, repeated
    until no π_i exceeds 1, so that Σ π_i = m and 0 ≤ π_i ≤ 1. When fewer than m rows have p_i > 0, those rows get
    π_i = 1 and the remaining slots go to p_i = 0 rows (they keep the row count and add nothing to the loss): to the
    rows with the highest `filler` score (≥ 0; e.g. 1/c: the cheapest rows) for sure, rows tied at the last score
    taken sharing the slots left evenly (so with no `filler`, or all scores equal, every such row alike).
    """
    n = p.numel()
    if not 0 < m <= n:
        raise ValueError(f"m must satisfy 0 < m <= N={n}, got {m}")
    p = _clean(p).double().clamp(min=0.0)
    fill = torch.zeros_like(p) if filler is None else _clean(filler).double().clamp(min=0.0).to(p.device)
    pi = torch.zeros_like(p)
    capped = torch.zeros(n, dtype=torch.bool, device=p.device)
    while True:
        free = ~capped
        if not free.any():  # m = N: every row is kept
            break
        left = m - int(capped.sum())
        mass = p[free].sum()
        if mass <= 0:  # every row with p > 0 is kept: the `left` best filler rows
            pi[free] = _best_rows(fill[free], left)
            break
        pi[free] = left * p[free] / mass
        over = free & (pi >= 1.0 - 1e-12)  # within rounding of 1 (e.g. m·(1/m) = 0.999…): kept for sure, exactly 1
        if not over.any():
            break
        capped |= over
        pi[capped] = 1.0
    return pi.clamp(0.0, 1.0)


def _best_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """π of k rows taken by highest score: 1 above the k-th score, rows tied at it sharing what is left, 0 below."""
    kth = torch.sort(scores, descending=True).values[max(k, 1) - 1]
    above, tied = scores > kth, scores == kth
    out = above.to(scores.dtype)
    out[tied] = max(k - int(above.sum()), 0) / int(tied.sum())
    return out


@dataclass
class Draw:
    """A draw of m distinct rows; `weights[k]` belongs to `indices[k]`."""

    indices: torch.Tensor  # (m,) long
    weights: torch.Tensor  # (m,) float64, the unbiasing weights before normalisation
    probabilities: torch.Tensor  # (N,) the inclusion probabilities π the weights came from


def draw_systematic(
    p: torch.Tensor, m: int, generator: torch.Generator | None = None, filler: torch.Tensor | None = None
) -> Draw:
    """Fixed-size systematic PPS draw of m distinct rows, Horvitz–Thompson weights w_i = m / (N π_i).

    π = inclusion_probabilities(p, m, filler); with one uniform u ∈ [0, 1), row i is kept when an integer-offset point
    u + k (k = 0..m−1) falls in (Π_{i−1}, Π_i], Π the cumulative sum of π. Each row is kept with probability
    exactly π_i, so E[(1/m) Σ_kept w_i L_i] = (1/m) Σ_i π_i m L_i / (N π_i) = (1/N) Σ_i L_i. The row order is
    randomly permuted first so that which rows end up together does not depend on their order in the batch.
    """
    n = p.numel()
    pi = inclusion_probabilities(p, m, filler)
    perm = torch.randperm(n, generator=generator).to(pi.device)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cum = torch.cumsum(pi[perm], 0)
    cum = cum * (m / cum[-1])  # Σπ = m exactly, so the last point u + m − 1 < m always lands
    points = u + torch.arange(m, dtype=torch.float64, device=pi.device)
    pos = torch.searchsorted(cum, points, right=True).clamp(max=n - 1)
    idx = perm[pos]
    weights = m / (n * pi[idx])
    return Draw(indices=idx, weights=weights, probabilities=pi)


@dataclass
class WeightStats:
    mean: float
    min: float
    max: float
    ess: float  # effective sample size (Σw)² / Σw²
    ess_fraction: float  # ESS / number of weights
    frac_floored: float

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in self.__dict__.items()}


def effective_sample_size(w: torch.Tensor) -> float:
    """ESS = (Σ w)² / Σ w²; 0 for an all-zero weight vector."""
    w = w.double()
    if w.numel() and w.abs().max() > 0:
        w = w / w.abs().max()  # scale-free; keeps w² from under- or overflowing
    sq = (w * w).sum()
    return float(w.sum() ** 2 / sq) if sq > 0 else 0.0


def design_weight_terms(probabilities: torch.Tensor, support: torch.Tensor, m: int) -> tuple[float, float]:
    """(E[Σ w], K): one rank's expected sum of the unbiasing weights over its kept non-filler slots, E[Σ w] =
    m |S⁺| / N (S⁺ = {i ∈ S : π_i > 0}, w_i = m / (N π_i)), and the number of those slots, K = Σ_{i∈S} π_i, which is
    not random. Summed over ranks they give the centre w̄₀ = Σ E[Σ w] / Σ K of the normalised weights
    (`normalize_weights`): |S⁺|/N on one rank with |S⁺| ≥ m, 1 only when every row can be drawn (docs/algorithm.md
    §2.5 derives it: weights centred at 1 would multiply the policy gradient by ≈ N/|S⁺|).
    """
    probs = _clean(probabilities).double().clamp(min=0.0)
    inside = support.to(torch.bool).to(probs.device)
    n = probs.numel()
    drawable = int((inside & (probs > 0)).sum())
    slots = float(probs[inside].sum())
    return m * drawable / n, slots


def normalize_weights(
    weights: torch.Tensor, method: str = "none", center: float = 1.0
) -> tuple[torch.Tensor, WeightStats]:
    """Normalise importance weights over the kept set (pass the weights of *all* ranks for a global normalisation).

    - "none":      w̃ = w                                (unbiased)
    - "recenter":  w̃ = max(0, w − mean(w) + w̄₀)         (mean w̄₀ before the floor; biased by O(1/m))

    with w̄₀ = `center`, the design's expected mean weight (`design_weight_terms`: |S⁺|/N on one rank, 1 only when
    every row can be drawn), so that recentring keeps E[mean w̃] ≈ E[mean w] and the gradient's scale. A negative
    weight would flip the sign of a row's advantage, which no reweighting of TRL's clipped surrogate allows: the
    fraction floored at 0 is reported. Returns (w̃, stats); non-finite inputs are treated as 0.
    """
    if method not in WEIGHT_NORMALIZATIONS:
        raise ValueError(f"weight normalisation must be one of {WEIGHT_NORMALIZATIONS}, got {method!r}")
    if not (math.isfinite(center) and center >= 0.0):
        raise ValueError(f"the weights' centre must be finite and non-negative, got {center}")
    w = _clean(weights).double()
    if w.numel() == 0:
        return w, WeightStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    floored = torch.zeros_like(w, dtype=torch.bool)
    if method == "recenter":
        w = w - w.mean() + center
        floored = w < 0
        w = w.clamp(min=0.0)
    ess = effective_sample_size(w)
    stats = WeightStats(
        mean=float(w.mean()),
        min=float(w.min()),
        max=float(w.max()),
        ess=ess,
        ess_fraction=ess / w.numel(),
        frac_floored=float(floored.double().mean()),
    )
    return w, stats


def _scaled(g: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g and c divided by their maxima: the J ratios are scale-free, and this keeps g² and Σc from overflowing."""
    g = _clean(g).double().abs()
    c = _clean_costs(c).double()
    if g.max() > 0:
        g = g / g.max()
    return g, c / c.max()


def j_ratio_ideal(g: torch.Tensor, c: torch.Tensor) -> float:
    """Best cost ratio the theory allows against uniform sampling (Cauchy–Schwarz):

        J(p*)/J(u) = (Σ_i g_i √c_i)² / ((Σ_i g_i²)(Σ_i c_i))   ∈ (0, 1].

    All-zero g (nothing to learn from the batch) returns 1.0: no sampler beats uniform there.
    """
    g, c = _scaled(g, c)
    denom = (g * g).sum() * c.sum()
    if denom <= 0:
        return 1.0
    return float(((g * c.sqrt()).sum() ** 2 / denom).clamp(max=1.0))


def j_ratio_achieved(g: torch.Tensor, c: torch.Tensor, p: torch.Tensor) -> float:
    """Cost ratio of sampling from p against uniform, J(p)/J(u), with J(p) = (Σ_i g_i²/p_i)(Σ_i p_i c_i).

    J(u) = (Σ g_i²)(Σ c_i). Terms with g_i = 0 contribute 0 to S(p) whatever p_i; g_i > 0 with p_i = 0 makes the
    estimator biased and J infinite: that is reported as `math.inf`, never NaN. All-zero g returns 1.0.
    """
    g, c = _scaled(g, c)
    p = _clean(p).double().clamp(min=0.0)
    p = p / p.sum() if p.sum() > 0 else torch.full_like(p, 1.0 / p.numel())
    g2 = g * g
    if g2.sum() <= 0:
        return 1.0
    if bool(((g2 > 0) & (p <= 0)).any()):
        return math.inf
    pos = g2 > 0
    s = (g2[pos] / p[pos]).sum()
    cost = (p * c).sum()
    return float(s * cost / (g2.sum() * c.sum()))


def kept_row_count(n: int, kept_fraction: float, multiple_of: int = 1) -> int:
    """m = round(kept_fraction · N) rounded down to a multiple of `multiple_of`, the layout's unit
    (`layout.kept_multiple`: `steps_per_generation` under the even layout, k = S/gcd(S, G) under the packed one), so
    every unit gets the same number of rows; at least `multiple_of`. Requires N to be a multiple of `multiple_of`."""
    if n % multiple_of:
        raise ValueError(f"N={n} must be a multiple of {multiple_of}")
    m = round(kept_fraction * n)
    m = (m // multiple_of) * multiple_of
    return max(multiple_of, min(m, n))


def expected_kept_cost(p: torch.Tensor, costs: torch.Tensor, m: int, filler: torch.Tensor | None = None) -> float:
    """E[Σ_kept c_i] = Σ_i π_i(m) c_i of the systematic draw of m rows (`draw_systematic` keeps row i with probability
    exactly π_i = `inclusion_probabilities(p, m, filler)`, filler rows included)."""
    return float((inclusion_probabilities(p, m, filler) * _clean_costs(costs).double()).sum())


def kept_rows_for_token_budget(
    p: torch.Tensor, costs: torch.Tensor, budget: float, n_max: int, filler: torch.Tensor | None = None
) -> int:
    """The largest m in [1, n_max] with Σ_i π_i(m) c_i ≤ budget, π(m) = inclusion_probabilities(p, m, filler): the
    systematic draw's expected kept cost, exactly, however skewed the batch (rows at π_i = 1 count in full). It grows
    with m, so a bisection finds m; 1 when even one row costs more than the budget in expectation."""
    lo, hi = 1, min(int(n_max), p.numel())  # invariant: the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if expected_kept_cost(p, costs, mid, filler) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def capped_kept_count(m: int, informative_max: int, multiple_of: int = 1) -> int:
    """Never more slots than the rows that can carry gradient need:

        m' = min(m, max(k, ⌊informative_max / k⌋ · k)),   k = multiple_of (the layout's unit, `layout.kept_multiple`),

    with `informative_max` the largest number of eligible rows (`eligible_rows`) on any rank, so m' is the same on
    every rank. m' ≤ informative_max whenever informative_max ≥ k; below that every unit still needs one row per rank
    and m' = k."""
    floor = (informative_max // multiple_of) * multiple_of
    return min(m, max(multiple_of, floor))
