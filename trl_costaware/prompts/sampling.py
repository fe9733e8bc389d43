"""Cost-aware before generation: the prompt stage's math (pure torch, no trainer in sight).

Notation (docs/prompt_sampling.md). The data set has P prompts; a generation batch draws K of them and generates G
rollouts for each. Prompt j's term of the GRPO policy gradient is its group's sum g_j = Σ_{rows i of j} A_i ∇ℓ_i / Z.
When the G rewards are equal every A_i is 0 and g_j = 0: that group's generation bought no gradient.

Cost-aware SGD over the prompts (the paper's p* ∝ G_i / √c_i, applied to prompts instead of rows):

    s_j = v̂_j / √ĉ_j,       q_j = (1 − α) s_j / Σ_k s_k + α / P,

with v̂_j the prompt's predicted gradient magnitude, ĉ_j its predicted cost and α > 0 the uniform mix that keeps every
prompt drawable (which is what makes the estimator unbiased). K prompts are drawn without replacement with inclusion
probabilities π_j (`sampling.inclusion_probabilities`, Σ π = K) by the systematic draw, and each drawn prompt's rows
carry the Horvitz–Thompson weight

    w_j = K / (P π_j),        E[Σ_{drawn j} w_j g_j] = Σ_j π_j K g_j / (P π_j) = (K/P) Σ_j g_j,

the expected policy-gradient sum of a uniformly drawn batch of K prompts, at the current parameters, whatever q is
(given the history that chose q). The row sampler then runs on the generated batch with the weighted advantages;
the two weights multiply.

The value v̂_j comes from a Beta(a_j, b_j) posterior on the prompt's pass rate. With the group's success share
p̂ = k/G, k ~ BetaBinomial(G, a_j, b_j), TRL's group advantages give

    Σ_i |A_i| = 2G √(p̂(1 − p̂))   (scale_rewards="group": rewards divided by the group's std)
    Σ_i |A_i| = 2G p̂(1 − p̂)      (scale_rewards="none"),

so v̂_j = E[√(p̂(1 − p̂))] (or E[p̂(1 − p̂)]) under the Beta-binomial, and the predicted probability that the group
carries no gradient is P(k = 0) + P(k = G). Rewards that are not binary enter as fractional successes, each reward
mapped into [0, 1] by the smallest and largest reward seen so far (`success_counts`): exact for binary rewards, a
pseudo-count approximation otherwise. The cost ĉ_j = prompt tokens + the prompt's mean completion tokens (both stages
pay per token: G × that for generation, and the update for the kept rows); an unseen prompt gets the mean over seen
ones.
"""

from __future__ import annotations

import torch

from ..core.sampling import Draw, draw_systematic

# scale_rewards values whose group advantages depend on the group alone (a batch-level scale would change with q).
VALUE_SCALES = ("group", "none")
PRIOR = (1.0, 1.0)  # Beta pseudo-counts of an unseen prompt's pass rate (uniform)


def beta_binomial_pmf(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """P(k successes of n) under BetaBinomial(n, a, b), shape (len(a), n + 1):

    P(k) = C(n, k) B(k + a, n − k + b) / B(a, b), computed in log space (float64)."""
    a = a.double().clamp(min=1e-6).unsqueeze(1)
    b = b.double().clamp(min=1e-6).unsqueeze(1)
    k = torch.arange(n + 1, dtype=torch.float64).unsqueeze(0)

    def log_beta(x, y):
        return torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)

    log_choose = (
        torch.lgamma(torch.tensor(n + 1.0, dtype=torch.float64)) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1)
    )
    log_p = log_choose + log_beta(k + a, n - k + b) - log_beta(a, b)
    p = log_p.exp()
    return p / p.sum(1, keepdim=True)


def group_value(pmf: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """v̂ = E[f(k/G)] under `pmf` (rows of `beta_binomial_pmf`): f(x) = √(x(1 − x)) for scale "group", x(1 − x) for
    "none" (Σ|A| of the group over 2G, see the module docstring)."""
    if scale not in VALUE_SCALES:
        raise ValueError(f"scale must be one of {VALUE_SCALES}, got {scale!r}")
    n = pmf.shape[1] - 1
    x = torch.arange(n + 1, dtype=torch.float64) / max(n, 1)
    f = x * (1 - x)
    if scale == "group":
        f = f.sqrt()
    return pmf.double() @ f


def zero_variance_probability(pmf: torch.Tensor) -> torch.Tensor:
    """P(every reward of the group equal) = P(k = 0) + P(k = G) for a binary reward."""
    return pmf[:, 0].double() + pmf[:, -1].double()


def prompt_distribution(value: torch.Tensor, cost: torch.Tensor, smoothing: float) -> torch.Tensor:
    """q_j = (1 − α) s_j / Σ s + α / P with s_j = v̂_j / √ĉ_j (uniform when every s_j is 0), α = `smoothing`."""
    if not 0.0 < smoothing <= 1.0:
        raise ValueError(f"smoothing must be in (0, 1] (every prompt must stay drawable), got {smoothing}")
    value = torch.nan_to_num(value.double(), nan=0.0).clamp(min=0.0)
    s = value / cost.double().clamp(min=1.0).sqrt()
    n = s.numel()
    uniform = torch.full_like(s, 1.0 / n)
    q = s / s.sum() if s.sum() > 0 else uniform
    p = (1.0 - smoothing) * q + smoothing * uniform
    return p / p.sum()


def greso_scores(last_zero_variance: torch.Tensor, explore: float) -> torch.Tensor:
    """A GRESO-style filter as a distribution (a benchmark baseline, biased): a prompt whose last visit was
    zero-variance is drawn with relative chance `explore`, every other prompt (unseen included) with chance 1."""
    return torch.where(last_zero_variance.bool(), torch.tensor(float(explore)), torch.tensor(1.0)).double()


def draw_prompts(q: torch.Tensor, k: int, generator: torch.Generator) -> Draw:
    """K distinct prompts by the systematic PPS draw (`sampling.draw_systematic`), in random order, with
    Horvitz–Thompson weights w_j = K / (P π_j)."""
    if not 0 < k <= q.numel():
        raise ValueError(f"cannot draw {k} distinct prompts from a data set of {q.numel()}")
    return draw_systematic(q, k, generator)


def success_counts(rewards: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Successes per group (rows of `rewards`, shape (K, G)): Σ_i (r_i − low) / (high − low), each term clipped to
    [0, 1]; for a binary reward with low/high its two values, the number of successes. NaN rewards count as `low`."""
    r = torch.nan_to_num(rewards.double(), nan=low)
    if high <= low:
        return torch.zeros(len(r), dtype=torch.float64)
    return ((r - low) / (high - low)).clamp(0.0, 1.0).sum(1)


def forget_and_update(a, b, successes, trials, forgetting: float, prior=PRIOR):
    """The posterior after one visit, forgetting the past: each pseudo-count's excess over the prior decays by
    `forgetting` (γ ∈ [0, 1]; 1 never forgets, 0 keeps the last visit only) before the visit's counts are added:

        a ← a₀ + γ (a − a₀) + k,      b ← b₀ + γ (b − b₀) + (G − k)."""
    a0, b0 = prior
    a = a0 + forgetting * (a.double() - a0) + successes.double()
    b = b0 + forgetting * (b.double() - b0) + (trials - successes.double())
    return a, b


def token_normaliser_factor(weights: torch.Tensor, tokens: torch.Tensor) -> float:
    """For a loss divided by the generation batch's tokens (dapo, cispo, vespo, bnpo): T / Σ_j w_j T_j, with T_j the
    loss tokens of drawn prompt j's group and T = Σ_j T_j. Multiplied into every row's advantage, it replaces the
    batch's own token count (which follows q) by its Horvitz–Thompson estimate under uniform prompts, Σ_j w_j T_j
    (unbiased for the uniform batch's expected tokens; the ratio has an O(1/K) bias). 1 for an empty batch."""
    t = tokens.double()
    estimate = float((weights.double() * t).sum())
    total = float(t.sum())
    return total / estimate if estimate > 0 and total > 0 else 1.0
