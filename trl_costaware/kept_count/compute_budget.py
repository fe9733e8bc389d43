"""The kept count that minimises the predicted cost of a run to its target (`cost_aware_kept_fraction="compute"`).

Pure functions of host numbers; docs/budget_and_proxy.md §3 derives them. Notation as in `budget.py`: N rows on this
rank, gradient-norm proxies G_i, the sampling distribution p, inclusion probabilities π_i(m) and the predicted variance
inflation I(m) of an m-row sample over the full batch (`budget.variance_inflation`).

**Steps to a target.** The empirical model of large-batch training (McCandlish, Kaplan, Amodei et al. 2018, "An
Empirical Model of Large-Batch Training", arXiv 1812.06162) gives the optimizer steps to a target as

    S(B) ≈ S_min · (1 + B_noise / B),      B_noise = tr(Σ) / |G|²,

with Σ the per-row gradient covariance, G the true gradient and B the batch size, for SGD at a tuned learning rate;
under Adam and the other per-coordinate normalised optimizers at a fixed learning rate the steps grow as the square
root, √(1 + B_noise / B) (`prompt_count.step_factor`, the step model the prompt count uses too; BENCHMARKS.md §10.1
measured it). An m-row importance-weighted sample of an N-row batch does not multiply all of the batch's noise: which
prompts were drawn (the between-prompt part) is not changed by which of their rows are kept, only the within-group
part is. With ρ = B_noise / N the full batch's noise-to-signal ratio, w its within-group share (both measured by the
noise probe, `noise_probe.py`; w = 1 without it, every row priced as independent) and I(m) the sample's predicted
inflation over rows taken as independent, the sample's noise-to-signal ratio is ρ (1 + w I(m)), and

    S(m) ∝ step_factor(ρ (1 + w I(m))):    1 + ρ (1 + w I(m))  ("sgd"),    √(1 + ρ (1 + w I(m)))  ("adam").

**Cost of a step.** C_fix does not shrink with m (generation, scoring, the optimizer step); the update (forward and
backward, old-policy and reference passes) costs κ per kept policy token, and an m-row draw keeps
T(m) = Σ_i π_i(m) t_i tokens in expectation (t_i = prompt + completion tokens of row i; m Σ_i p_i t_i for the
multinomial draw). The run's cost to the target is then proportional to

    J(m) = S(m) · (C_fix + κ T(m)),

and the rule keeps the m (a multiple of the layout's rounding) that minimises it. Limits: ρ → 0 or w = 0 gives the
smallest m (the sample's noise costs no steps, so only its price counts); ρ = ∞ keeps all N rows; for large finite ρ
the "sgd" rule minimises (1 + w I(m)) (C_fix + κ T(m)) (the "adam" rule with the square root of the first factor),
which keeps every row that can carry gradient (I = 0) once C_fix dominates,
or when the rows are alike (k equal rows: (1 + I(m)) T(m) = (k/m)(m/k) T(k) is flat and (k/m) C_fix falls with m),
and is the variance × cost objective of cost-aware SGD when C_fix = 0. Nothing else about the batch enters, so m
is a function of the batch and the run's measured signals, not of the draw: the estimate stays unbiased given m.

**The noise scale, measured.** ρ comes from the noise probe where it runs (`noise_probe.py`: within one point of the
parameters, with w). Elsewhere (the probe off, DeepSpeed ZeRO-0/1) it comes from the optimizer steps' own gradients
(`noise_terms`), with w = 1: with G_t the step's
accumulated gradient before clipping and G_{t'} that of the latest step of an earlier generation batch (its rows are
independent of step t's), E[G_t · G_{t'}] ≈ |G|² and E|G_t|² = |G|² + V_t, where V_t = (tr Σ / B)(1 + I_t) is the
variance of step t's estimate with its own kept sample's inflation I_t. Each step gives

    signal_t = G_t · G_{t'},      noise_t = (|G_t|² − G_t · G_{t'}) / (1 + I_t),

both smoothed by an exponential moving average (as the paper recommends for the ratio of two noisy terms), and
ρ = EMA(noise) / EMA(signal); a non-positive signal means noise dominates: ρ = ∞. The estimator reads one gradient
norm and one dot product per optimizer step and keeps one copy of the gradient; it needs no extra forward or
backward. The gradient drifts between the two steps, which lowers the signal and errs toward a larger ρ (more rows
kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.sampling import _clean, inclusion_probabilities
from .budget import variance_inflation
from .prompt_count import step_factor

COST_MODELS = ("time", "tokens")
# The rule's search: at most GRID candidate counts, then GRID more between the best one's neighbours.
GRID = 24


@dataclass
class NoiseScale:
    """EMAs of the two terms of ρ (module docstring); `update` takes one optimizer step's raw terms. Both start at 0
    (their bias toward 0, 1 − decay^count, is the same and cancels in the ratio)."""

    decay: float = 0.9
    noise: float = 0.0
    signal: float = 0.0
    count: int = 0

    def update(self, grad_sq: float, grad_dot: float, inflation: float) -> None:
        noise, signal = noise_terms(grad_sq, grad_dot, inflation)
        if not (math.isfinite(noise) and math.isfinite(signal)):
            return
        d = self.decay
        self.noise = d * self.noise + (1 - d) * noise
        self.signal = d * self.signal + (1 - d) * signal
        self.count += 1

    @property
    def ratio(self) -> float | None:
        """ρ = EMA(noise) / EMA(signal): None before the first pair of steps, ∞ when the signal is not positive."""
        if self.count == 0:
            return None
        if self.signal <= 0:
            return math.inf
        return max(self.noise, 0.0) / self.signal

    def state_dict(self) -> dict:
        return {"noise": self.noise, "signal": self.signal, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.noise, self.signal, self.count = float(state["noise"]), float(state["signal"]), int(state["count"])


def noise_terms(grad_sq: float, grad_dot: float, inflation: float) -> tuple[float, float]:
    """(noise_t, signal_t) of one optimizer step: ((|G_t|² − G_t·G_t') / (1 + I_t), G_t·G_t'), module docstring.
    `inflation` I_t ≥ 0 is the predicted variance inflation of the step's kept sample (0 for the full batch)."""
    if not inflation >= 0:
        raise ValueError(f"inflation must be >= 0, got {inflation}")
    return (grad_sq - grad_dot) / (1.0 + inflation), grad_dot


# The estimator reads each gradient tensor in slices of at most this many elements (64 MiB as float32), so that its
# float32 temporaries stay a few slices whatever the parameter's size (`gradient_terms`).
GRADIENT_SLICE = 1 << 24


def gradient_terms(
    grads: list[torch.Tensor], previous: list[torch.Tensor] | None = None, slice_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(|G|², G · H) of a gradient held as tensors G = `grads` (and H = `previous`, the same shapes, any dtypes):

        |G|² = Σ_p Σ_j g_pj²,      G · H = Σ_p Σ_j g_pj h_pj      (None without `previous`),

    as float32 0-d tensors on the first gradient's device, with no device→host transfer. Every tensor is read
    flattened in slices of `slice_size` elements (`GRADIENT_SLICE` by default), each slice cast to float32 on its own
    and summed by torch's reduction (cascade summation on CPU: `vector_norm` and `dot` there lose up to 1e-3 relative
    on 2^24 elements), the slices' sums added in float32. So the float32 temporaries are at most three slices (the dot
    product of two low-precision slices: both casts and their product), never a float32 copy of a whole parameter."""
    if not grads:
        raise ValueError("no gradient to read")
    if previous is not None and len(previous) != len(grads):
        raise ValueError(f"{len(grads)} gradient tensors but {len(previous)} previous ones")
    slice_size = slice_size or GRADIENT_SLICE
    device = grads[0].device
    squares, dots = [], []
    for i, g in enumerate(grads):
        g = g.detach().reshape(-1)
        h = None if previous is None else previous[i].detach().reshape(-1)
        if h is not None and h.numel() != g.numel():
            raise ValueError(f"tensor {i}: {g.numel()} elements against {h.numel()} previous ones")
        for start in range(0, g.numel(), slice_size):
            a = g[start : start + slice_size].float()
            squares.append(a.square().sum().to(device))
            if h is not None:
                dots.append((a * h[start : start + slice_size].float()).sum().to(device))
    zero = torch.zeros((), dtype=torch.float32, device=device)
    square = torch.stack(squares).sum() if squares else zero
    if previous is None:
        return square, None
    return square, torch.stack(dots).sum() if dots else zero


def rows_per_optimizer_step(rows_per_generation: float, steps_per_generation: int, accumulation_steps: int) -> float:
    """The rows behind one optimizer step's gradient, N · G / S: a generation batch of N rows (all ranks) is split over
    S = `steps_per_generation` micro-steps, and an optimizer step accumulates G = `gradient_accumulation_steps` of
    them, so S / G optimizer steps per generation batch (a fraction when G ∤ S: with G > S one step spans several
    generation batches of N rows each). The gradient noise scale in rows is then B_noise = ρ · N · G / S."""
    if steps_per_generation <= 0 or accumulation_steps <= 0:
        raise ValueError(f"steps must be positive, got S={steps_per_generation}, G={accumulation_steps}")
    return rows_per_generation * accumulation_steps / steps_per_generation


@dataclass
class Ema:
    """An exponential moving average with the start-up bias removed (Adam's correction): `value` is None before the
    first finite update, then Σ_k d^(n−k) x_k / Σ_k d^(n−k)."""

    decay: float = 0.9
    total: float = 0.0
    weight: float = 0.0

    def update(self, x: float) -> float | None:
        if math.isfinite(x):
            self.total = self.decay * self.total + (1 - self.decay) * x
            self.weight = self.decay * self.weight + (1 - self.decay)
        return self.value

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


def expected_kept_tokens(p: torch.Tensor, tokens: torch.Tensor, m: int, scheme: str = "systematic") -> float:
    """T(m): the tokens an m-row draw from p keeps in expectation, Σ_i π_i(m) t_i (systematic) or m Σ_i p_i t_i
    (multinomial, p normalised)."""
    t = _clean(tokens).double().clamp(min=0.0)
    p = _clean(p).double().clamp(min=0.0)
    if scheme == "multinomial":
        total = float(p.sum())
        return m * float((p * t).sum()) / total if total > 0 else m * float(t.mean())
    return float((inclusion_probabilities(p, m) * t).sum())


def predicted_cost(
    rho: float,
    inflation: float,
    fixed_cost: float,
    token_cost: float,
    kept_tokens: float,
    within_share: float = 1.0,
    step_model: str = "sgd",
) -> float:
    """J(m) = step_factor(ρ (1 + w I(m))) · (C_fix + κ T(m)), in the units of the costs (up to the constant S_min):
    (1 + ρ (1 + w I(m))) under ``"sgd"``, its square root under ``"adam"`` (`prompt_count.step_factor`, the prompt
    count's step model). w = `within_share` is the share of the batch's noise a row sample multiplies (module
    docstring: 1 prices every row as independent)."""
    if not 0.0 <= within_share <= 1.0:
        raise ValueError(f"within_share must be in [0, 1], got {within_share}")
    return step_factor(rho * (1.0 + within_share * inflation), step_model) * (fixed_cost + token_cost * kept_tokens)


@dataclass(frozen=True)
class ComputeChoice:
    """The rule's choice: `m`, its inflation I(m), and J(m) / J(N), the predicted cost to the target relative to
    keeping every row (≤ 1)."""

    m: int
    inflation: float
    cost_ratio: float


def cheapest_kept_count(
    g: torch.Tensor,
    p: torch.Tensor,
    tokens: torch.Tensor,
    rho: float,
    fixed_cost: float,
    token_cost: float,
    multiple_of: int = 1,
    scheme: str = "systematic",
    within_share: float = 1.0,
    step_model: str = "sgd",
) -> ComputeChoice:
    """The m in {multiple_of, 2·multiple_of, …, N} minimising J(m) (module docstring; `within_share` w and
    `step_model` as in `predicted_cost`), ties to the larger m.

    `g` the proxies G_i (0 on rows that cannot carry gradient), `p` the sampling distribution, `tokens` each row's
    policy tokens t_i, `rho` = B_noise / N ≥ 0 (∞: keep every row), `fixed_cost` C_fix ≥ 0 and `token_cost` κ ≥ 0 in
    one unit. J is searched on a grid of at most `GRID` counts, then on every count (up to `GRID`) between the best
    one's neighbours; a count whose I(m) is infinite (a row with G > 0 that cannot be drawn) is never chosen."""
    n = p.numel()
    if multiple_of <= 0 or n % multiple_of:
        raise ValueError(f"N={n} must be a positive multiple of multiple_of={multiple_of}")
    for name, value in (("rho", rho), ("fixed_cost", fixed_cost), ("token_cost", token_cost)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    units = n // multiple_of
    if math.isinf(rho) or units == 1:
        return ComputeChoice(n, 0.0 if scheme == "systematic" else variance_inflation(g, p, n, scheme), 1.0)

    cache: dict[int, tuple[float, float]] = {}

    def cost(u: int) -> float:
        if u not in cache:
            m = u * multiple_of
            inflation = variance_inflation(g, p, m, scheme)
            kept = expected_kept_tokens(p, tokens, m, scheme)
            j = (
                math.inf
                if math.isinf(inflation)
                else predicted_cost(rho, inflation, fixed_cost, token_cost, kept, within_share, step_model)
            )
            cache[u] = (j, inflation)
        return cache[u][0]

    def best(candidates) -> int:
        return min(sorted(set(candidates), reverse=True), key=cost)  # ties: the larger m (fewer steps)

    grid = sorted({max(1, round(1 + k * (units - 1) / (GRID - 1))) for k in range(GRID)}) if units > GRID else None
    if grid is None:
        u = best(range(1, units + 1))
    else:
        u0 = best(grid)
        i = grid.index(u0)
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        step = max(1, (hi - lo) // GRID)
        u = best([*range(lo, hi + 1, step), u0])
    full = cost(units)
    j, inflation = cache[u]
    ratio = j / full if math.isfinite(full) and full > 0 else 1.0
    return ComputeChoice(u * multiple_of, inflation, ratio)


@dataclass(frozen=True)
class ComputeSignal:
    """What the run has measured for the rule, per rank: `rho` = B_noise / N (None: no estimate yet; the rule keeps
    every row), `available` False where the estimator cannot read the gradient (DeepSpeed ZeRO-2/3, FSDP: the rule
    falls back to the variance rule of `budget.smallest_budget`), `fixed_cost` C_fix and `token_cost` κ per kept
    policy token (seconds when measured; None: the token model, C_fix = `generation_token_cost` × the batch's
    generated tokens and κ = `token_cost`)."""

    rho: float | None = None
    available: bool = True
    fixed_cost: float | None = None
    token_cost: float = 1.0
    generation_token_cost: float = 1.2
    within_share: float = 1.0  # w: the share of the noise a row sample multiplies (1: rows priced as independent)
    step_model: str = "sgd"  # `prompt_count.step_factor`: "adam" for the per-coordinate normalised optimizers

    def costs(self, generated_tokens: float) -> tuple[float, float]:
        """(C_fix, κ) for a batch with `generated_tokens` generated tokens on this rank."""
        if self.fixed_cost is None:
            return self.generation_token_cost * generated_tokens, self.token_cost
        return self.fixed_cost, self.token_cost
