"""Cost-aware before generation: the prompt stage's math (pure torch, no trainer in sight).

Notation (docs/prompt_sampling.md). The data set has P prompts; a generation batch draws K of them and generates G
rollouts for each. Prompt j's term of the GRPO policy gradient is its group's sum g_j = Σ_{rows i of j} A_i ∇ℓ_i / Z.
When the G rewards are equal every A_i is 0 and g_j = 0: that group's generation bought no gradient.

Cost-aware SGD over the prompts (the paper's p* ∝ G_i / √c_i, applied to prompts instead of rows):

    s_j = v̂_j / √ĉ_j,       q_j = (1 − α) s_j / Σ_k s_k + α / P,

with v̂_j the prompt's predicted gradient norm (the root of its expected second moment, below), ĉ_j its predicted
cost and α > 0 the uniform mix that keeps every prompt drawable (which is what makes the estimator unbiased). K
prompts are drawn without replacement with inclusion probabilities π_j (`core.sampling.inclusion_probabilities`,
Σ π = K), an epoch's batches in one systematic pass (`epoch_layout`), and each drawn prompt's rows carry the
Horvitz–Thompson weight

    w_j = K / (P π_j),        E[Σ_{drawn j} w_j g_j] = Σ_j π_j K g_j / (P π_j) = (K/P) Σ_j g_j,

the expected policy-gradient sum of a uniformly drawn batch of K prompts, at the current parameters, whatever q is
(given the history that chose q). The row sampler then runs on the generated batch with the weighted advantages;
the two weights multiply.

The value v̂_j comes from a Beta(a_j, b_j) posterior on the prompt's pass rate. The optimum of J = S·C over
inclusion probabilities (S = Σ_j E‖g_j‖²/π_j, C = Σ_j π_j c_j) is π_j ∝ √(E‖g_j‖² / c_j) (Cauchy–Schwarz): the square
root of the expected SQUARED norm, ∝ E[Σ_i A_i²] for a group whose rows' gradients have similar norms. With the
group's success count k ~ BetaBinomial(G, a_j, b_j) and p̂ = k/G, TRL's group advantages give

    Σ_i A_i² = G − 1   for every group whose rewards differ    (scale_rewards="group": the group's Bessel std)
    Σ_i A_i² = G p̂(1 − p̂) = k(G − k)/G                          (scale_rewards="none": A_i = r_i − mean)

so E[Σ A²] = (G − 1)(1 − ẑ) with ẑ = P(k = 0) + P(k = G), and, for "none", E[k(G − k)]/G =
(G − 1) a b / ((a + b)(a + b + 1)) (the Beta-binomial's factorial moment E[k(G − k)] = G(G − 1) E[p(1 − p)]). The value
is v̂_j = √(E[Σ A²] / (G − 1)): √(1 − ẑ_j) ("group"), √(a b / ((a + b)(a + b + 1))) ("none").

The prior is fitted on the pool (`fit_prior`, the Beta-binomial's method of moments over the seen prompts' latest
visits) and each prompt's evidence decays toward it: the posterior is Beta(a₀ + e_a, b₀ + e_b), the evidence
e ← γ e + (the visit's counts). A pool whose prompts are either solved or unsolved gets a U-shaped prior (a₀, b₀ < 1),
under which a prompt solved at every visit is predicted zero-variance with a probability that tends to 1.

Rewards that are not binary enter as fractional successes, each reward mapped into [0, 1] by the smallest and largest
reward seen so far (`success_counts`): exact for binary rewards, a pseudo-count approximation otherwise.
The cost ĉ_j = prompt tokens + the prompt's mean completion tokens (both stages pay per token: G × that for
generation, and the update for the kept rows); an unseen prompt gets the mean over seen ones.
"""

from __future__ import annotations

import torch

from ..core.sampling import Draw, draw_systematic, inclusion_probabilities

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


def group_second_moment(pmf: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """E[Σ_i A_i²] of the next group under `pmf` (rows of `beta_binomial_pmf`, k = 0..G successes):

    "group": (G − 1) · (1 − P(k = 0) − P(k = G))     (TRL's Bessel std: Σ A² = G − 1 when the rewards differ)
    "none":  E[k (G − k)] / G                         (Σ (r_i − r̄)² = k (G − k) / G for a binary reward)."""
    if scale not in VALUE_SCALES:
        raise ValueError(f"scale must be one of {VALUE_SCALES}, got {scale!r}")
    n = pmf.shape[1] - 1
    k = torch.arange(n + 1, dtype=torch.float64)
    if scale == "group":
        f = torch.full_like(k, float(max(n - 1, 0)))
        f[0], f[-1] = 0.0, 0.0
    else:
        f = k * (n - k) / max(n, 1)
    return pmf.double() @ f


def group_value(pmf: torch.Tensor, scale: str = "group") -> torch.Tensor:
    """v̂ = √(E[Σ A²] / (G − 1)) (`group_second_moment`): √(1 − ẑ) for scale "group", √(a b / ((a + b)(a + b + 1)))
    for "none" (under Beta(a, b)); the J = S·C optimum's numerator (see the module docstring)."""
    n = pmf.shape[1] - 1
    return (group_second_moment(pmf, scale) / max(n - 1, 1)).clamp(min=0.0).sqrt()


def fit_prior(successes: torch.Tensor, trials: int, *, min_mass: float = 0.05, max_mass: float = 100.0):
    """Beta(a₀, b₀) fitted on the pool by the Beta-binomial's method of moments, from one group per prompt (k_j of
    G = `trials` successes): with m and V the mean and variance of p̂_j = k_j / G,

        μ = m,     ρ = (V / (μ(1 − μ)) − 1/G) / (1 − 1/G)     (Var p̂ = μ(1 − μ)(1/G + (1 − 1/G) ρ)),
        a₀ + b₀ = 1/ρ − 1 (clipped to [`min_mass`, `max_mass`]),   a₀ = μ (a₀ + b₀).

    ρ near 1 (each prompt solved or failed) gives a U-shaped prior of small mass. With fewer than 2 prompts, or μ at 0
    or 1, the uniform `PRIOR`."""
    x = successes.double() / max(int(trials), 1)
    if x.numel() < 2:
        return PRIOR
    mu, var = float(x.mean()), float(x.var(unbiased=False))
    if not 1e-6 < mu < 1 - 1e-6:
        return PRIOR
    g = max(int(trials), 2)
    rho = (var / (mu * (1 - mu)) - 1.0 / g) / (1.0 - 1.0 / g)
    mass = 1.0 / min(max(rho, 1e-9), 1.0) - 1.0
    mass = min(max(mass, min_mass), max_mass)
    return (mu * mass, (1 - mu) * mass)


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


GRESO_FLOOR = 0.01  # GRESO's smallest chance of keeping a prompt
GRESO_STEP = 0.01  # how far each of GRESO's two base probabilities moves per generation batch


def greso_keep_probability(
    streak: torch.Tensor, easy: torch.Tensor, p_easy: float, p_hard: float, floor: float = GRESO_FLOOR
) -> torch.Tensor:
    """GRESO's pre-rollout filter (arXiv 2506.02177; a benchmark baseline, biased by design): a prompt whose last n
    visits were all zero-variance (n = `streak`) is kept with probability max(pⁿ, floor), skipped otherwise, with
    p = `p_easy` if its last zero-variance visit was all-correct (`easy`), `p_hard` if all-wrong. n = 0 (the last
    visit was informative, or the prompt is unseen) is always kept."""
    p = torch.where(easy.bool(), torch.tensor(float(p_easy)), torch.tensor(float(p_hard))).double()
    return torch.where(streak > 0, p.pow(streak.double()).clamp(min=floor), torch.ones_like(p))


def greso_adapt(p: float, share: float, target: float, step: float = GRESO_STEP, floor: float = GRESO_FLOOR) -> float:
    """GRESO's base probability after one batch: p − step if the batch's share of that type of zero-variance
    prompts was above `target` (skip more), p + step otherwise; within [floor, 1]."""
    return min(1.0, max(floor, p - step if share > target else p + step))


def greso_select(order: torch.Tensor, keep: torch.Tensor, k: int, generator: torch.Generator):
    """Walk the prompts in `order` (GRESO walks its data loader), keeping each with probability `keep[j]`, until K
    are kept: returns (kept, consumed), the kept prompts and how many of `order` were walked. Fewer than K kept when
    `order` runs out."""
    u = torch.rand(len(order), generator=generator, dtype=torch.float64)
    take = u < keep[order]
    kept_at = torch.nonzero(take).flatten()[:k]
    consumed = int(kept_at[-1]) + 1 if len(kept_at) == k else len(order)
    return order[kept_at], consumed


def draw_prompts(q: torch.Tensor, k: int, generator: torch.Generator) -> Draw:
    """K distinct prompts by the systematic PPS draw (`sampling.draw_systematic`), in random order, with
    Horvitz–Thompson weights w_j = K / (P π_j)."""
    if not 0 < k <= q.numel():
        raise ValueError(f"cannot draw {k} distinct prompts from a data set of {q.numel()}")
    return draw_systematic(q, k, generator)


def epoch_layout(q: torch.Tensor, k: int, draws: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A balanced epoch: `draws` = C generation batches of K distinct prompts each, all K·C slots laid out in ONE
    systematic pass. Returns (indices (C, K), π).

    π = inclusion_probabilities(q, K) (Σ π = K, π ≤ 1). The prompts, in a random order, get consecutive intervals of
    length C π_j on [0, C K); one uniform u gives the points u + m, m = 0..CK − 1; point m goes to residue m mod C,
    and the residues to the C batches by a random permutation σ; each batch's K prompts in a random order. Then

    - prompt j is visited ⌊C π_j⌋ or ⌈C π_j⌉ times in the epoch (its interval holds that many unit-spaced points);
    - a batch's points are u + σ(c) + C i, i = 0..K−1: a systematic sample of spacing C with a start uniform on
      [0, C), so prompt j (an interval of length C π_j ≤ C) is in batch c with probability exactly π_j, and at most
      once; the Horvitz–Thompson weights w_j = K / (P π_j) are those of a single draw.

    At uniform q with C K = P it is a random permutation cut into C batches (TRL's RepeatSampler epoch)."""
    n = q.numel()
    if not 0 < k <= n or draws < 1:
        raise ValueError(f"cannot lay out {draws} batches of {k} distinct prompts from a data set of {n}")
    pi = inclusion_probabilities(q, k)
    perm = torch.randperm(n, generator=generator)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cum = torch.cumsum(draws * pi[perm], 0)
    cum = cum * (draws * k / cum[-1])
    points = u + torch.arange(draws * k, dtype=torch.float64)
    idx = perm[torch.searchsorted(cum, points, right=True).clamp(max=n - 1)]
    slots = idx.view(k, draws).t()  # row r: the points m ≡ r (mod C)
    slots = slots[torch.randperm(draws, generator=generator)]
    within = torch.argsort(torch.rand(draws, k, generator=generator), dim=1)
    return torch.gather(slots, 1, within), pi


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
