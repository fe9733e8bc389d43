"""How many of a generation batch's prompts to generate for (`cost_aware_prompt_fraction`, issue 39).

Pure functions of host numbers; the trainer's wiring is `prompt_rule.py`, the derivation docs/prompt_count.md.

**Setting.** A rank's generation batch holds K_r whole groups (a prompt and its G rollouts; TRL's sampler puts a
group's rollouts next to each other). Before generation the trainer keeps k of each rank's K_r groups, the same k on
every rank, drawn uniformly without replacement (`draw_groups`), and generates for those only: φ = k / K_r of the
prompts. The prompts TRL's sampler drew are a uniform draw from the data, and a uniform k-subset of a uniform draw is
a uniform draw of k, so the step is exactly GRPO's step at φ K prompts: the same estimator, with whatever TRL does at
that batch size (every loss type, both stages of this package on top). Nothing is reweighted and nothing is biased;
what changes is the step's noise.

**Steps to a target.** With ρ = B_noise / B at the full batch (the noise-to-signal ratio of the full batch's
gradient: tr Var(g) / |𝐆|²), generating for φ of the prompts multiplies the gradient's noise by 1/φ. How the steps to
a target respond depends on the optimizer (`step_model_for`):

- SGD at a tuned learning rate (McCandlish, Kaplan, Amodei et al. 2018, arXiv 1812.06162): S(B) ∝ 1 + B_noise / B,

      S(φ) / S(1) = (1 + ρ / φ) / (1 + ρ)                                       (``"sgd"``);

- Adam, and every optimizer that divides each coordinate by a running root mean square of its gradient (Adagrad,
  RMSprop, Adafactor, Lion's sign), at a fixed learning rate: the step's size is fixed whatever the noise, so noise
  costs no curvature penalty and only tilts the direction. With v ≈ 𝐆ᵢ² + σᵢ²/B per coordinate the expected descent
  per step is ∝ Σᵢ 𝐆ᵢ² / √(𝐆ᵢ² + σᵢ²/B), which, at a common signal-to-noise ratio across coordinates, is
  ∝ 1 / √(1 + ρ), so

      S(φ) / S(1) = √((1 + ρ / φ) / (1 + ρ))                                    (``"adam"``).

  Measured on the regime matrix (BENCHMARKS.md §10.1, `benchmarks/response_model.py`), with ρ from lr-0 steps at
  each cell's start: within ±15% of the measured steps ratio at every target of the default testbed's two cells and
  at 10 of 18 on the long testbed's three, where the SGD form over-predicts at every target outside the
  noise-dominated cell.

With the row stage on, a step trains on a sample of what it generated, whose noise is the batch's times
b = 1 + w I (I the sample's predicted inflation, w the within-group share of the noise, measured by the noise probe:
a row sample multiplies only the within-group part). Every fraction is then compared at that b:
S(φ)/S(1) = step_factor(ρ b/φ) / step_factor(ρ b) (`predicted_step_ratio`'s `base`), the step model the kept count's
rule uses too (`compute_budget.predicted_cost`): one cost model for what a step generates and what it keeps.

**Cost of a step.** C(φ) = A + φ B: A does not shrink with the batch (the generation engine's latency floor, the
optimizer step), B is what scales with it, at φ = 1 (generated tokens times their price, kept policy tokens times
theirs). `StepCostFit` fits the generation part a + b x (x: the batch's generated tokens) from the run's own
batches, so A and B come from measured time, not from token counts alone.

**The objective.** The predicted compute to the target relative to the full batch,

    J(φ) = S(φ) C(φ) / (S(1) C(1)) = [S(φ) / S(1)] (A + φ B) / (A + B),

is minimised over the allowed φ = k / K_r, subject to S(φ) / S(1) ≤ r_max (`cost_aware_max_step_ratio`): a run may
take at most r_max times the full batch's steps, i.e. the trade between fewer GPU-hours and more steps (wall-clock,
and the learning-rate schedule's length) is the user's bound. Its unconstrained minimum is φ* = √(ρ A / B) under
``"sgd"`` and φ* = (ρ/4)(√(1 + 8A/(ρB)) − 1) under ``"adam"`` (the root of 2Bφ² + ρBφ − ρA = 0): with no per-step
cost (A = 0) J falls all the way to the smallest batch under either, so the bound is what stops the cut, at the φ
where S(φ)/S(1) = r_max:

    φ_min = ρ / (r (1 + ρ) − 1),    r = r_max ("sgd") or r_max² ("adam").

Limits: large ρ keeps every prompt (the step ratio bound is then met only near φ = 1); ρ → 0 cuts to the smallest
allowed k if A is small, or to φ* → 0 clamped at the bound. A degenerate ρ (not measured yet, NaN, ≤ 0 — an
estimate of no noise at all, which would cut to one group — or ∞, where the signal estimate is not positive) keeps
every prompt and says so (`PromptCountDecision.fallback`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

AUTO = "auto"
STEP_MODELS = ("adam", "sgd")  # how the steps to a target respond to the batch (module docstring)
# Pairs of optimizer steps the noise scale needs before the "auto" rule acts; before that every prompt is generated.
MIN_NOISE_PAIRS = 4


class PromptFraction(float):
    """The type of `cost_aware_prompt_fraction`: a number in (0, 1] or the string "auto" (as `budget.KeptFraction`:
    `PromptFraction("0.5")` is the float 0.5, `PromptFraction("auto")` the string "auto", so the field parses from the
    command line and YAML). The range is checked by the config."""

    def __new__(cls, value):
        if isinstance(value, str) and value.strip().lower() == AUTO:
            return AUTO
        if isinstance(value, bool):
            raise ValueError(f"expected a number in (0, 1] or 'auto', got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number in (0, 1] or 'auto', got {value!r}") from None


def allowed_counts(groups: int, generations: int, steps_per_generation: int) -> list[int]:
    """The group counts k ∈ [1, `groups`] a rank may generate for: those whose k·G rows split into
    `steps_per_generation` equal micro-batches (TRL's split drops a remainder), and always `groups` itself."""
    if groups < 1 or generations < 1 or steps_per_generation < 1:
        raise ValueError(
            f"groups, generations and steps_per_generation must be >= 1, got {groups}, {generations}, "
            f"{steps_per_generation}"
        )
    counts = [k for k in range(1, groups + 1) if (k * generations) % steps_per_generation == 0]
    return counts if groups in counts else [*counts, groups]


def fixed_count(groups: int, fraction: float, allowed: list[int]) -> int:
    """k for a fixed fraction: the allowed count nearest to fraction × groups (ties: the larger), at least the
    smallest allowed count."""
    target = fraction * groups
    return min(allowed, key=lambda k: (abs(k - target), -k))


def draw_groups(groups: int, k: int, generator: torch.Generator) -> list[int]:
    """k of `groups` group indices, uniformly without replacement, in increasing order (a uniform permutation's first
    k, from `generator`, a CPU generator)."""
    if not 1 <= k <= groups:
        raise ValueError(f"k must be in [1, {groups}], got {k}")
    if k == groups:
        return list(range(groups))
    return sorted(torch.randperm(groups, generator=generator)[:k].tolist())


def step_model_for(optim: str) -> str:
    """The step model of an optimizer (TrainingArguments.optim's name): ``"sgd"`` for plain SGD, ``"adam"`` for every
    optimizer that normalises each coordinate (Adam/AdamW in all their builds, Adafactor, Adagrad, RMSprop, Lion, ...;
    module docstring)."""
    name = str(getattr(optim, "value", optim)).lower()
    return "sgd" if name == "sgd" else "adam"


def step_factor(noise_to_signal: float, model: str = "adam") -> float:
    """Steps to a target, up to a constant, at a batch whose noise-to-signal ratio is x: 1 + x under ``"sgd"``,
    √(1 + x) under ``"adam"`` (module docstring). The one step model both rules price with: the prompt count here, the
    kept count in `compute_budget.predicted_cost`."""
    if model not in STEP_MODELS:
        raise ValueError(f"model must be one of {STEP_MODELS}, got {model!r}")
    linear = 1.0 + noise_to_signal
    return linear if model == "sgd" else math.sqrt(linear)


def predicted_step_ratio(rho: float, fraction: float, model: str = "adam", base: float = 1.0) -> float:
    """S(φ) / S(1) = step_factor(ρ b/φ) / step_factor(ρ b): (1 + ρb/φ) / (1 + ρb) under ``"sgd"``, its square root
    under ``"adam"`` (module docstring). b = `base` ≥ 1 is the noise multiplier of what the step trains on at every
    fraction (1: every generated row; 1 + w I with the row stage's sample, `compute_budget`); ρ = ∞ gives 1/φ (and
    1/√φ)."""
    if not fraction > 0:
        raise ValueError(f"fraction must be > 0, got {fraction}")
    if not base >= 1.0:
        raise ValueError(f"base must be >= 1, got {base}")
    if math.isinf(rho):
        return step_factor(1.0 / fraction - 1.0, model)
    return step_factor(rho * base / fraction, model) / step_factor(rho * base, model)


def predicted_compute_ratio(
    rho: float, fraction: float, fixed: float, variable: float, model: str = "adam", base: float = 1.0
) -> float:
    """J(φ) = S(φ) C(φ) / (S(1) C(1)) with C(φ) = fixed + φ variable (module docstring)."""
    full = fixed + variable
    if not full > 0:
        raise ValueError(f"a step must cost something: fixed + variable = {full}")
    return predicted_step_ratio(rho, fraction, model, base) * (fixed + fraction * variable) / full


@dataclass(frozen=True)
class PromptCountDecision:
    """The "auto" rule's choice for one generation batch, and what it predicted."""

    count: int  # groups generated on each rank
    fraction: float  # count / groups
    step_ratio: float  # predicted S(φ)/S(1)
    compute_ratio: float  # predicted J(φ)
    fallback: bool  # True: ρ or the costs were not usable, every prompt generated (today's behaviour)

    def metrics(
        self, rho: float | None, fixed: float | None, variable: float | None, model: str = "adam", base: float = 1.0
    ) -> dict[str, float]:
        """The decision's log entries: the fraction and the fallback flag always; the predictions where the rule
        predicted (finite numbers only)."""
        out = {"prompt_fraction": self.fraction, "prompt_rule_fallback": float(self.fallback)}
        if math.isfinite(self.step_ratio) and math.isfinite(self.compute_ratio):
            out["predicted_step_ratio"] = self.step_ratio
            out["predicted_compute_ratio"] = self.compute_ratio
        if not self.fallback and rho is not None and fixed is not None and variable is not None:
            out["prompt_noise_to_signal"] = float(rho)
            out["step_cost_fixed_share"] = float(fixed / (fixed + variable))
            for name, phi in (("half", 0.5), ("quarter", 0.25)):
                out[f"predicted_compute_{name}"] = predicted_compute_ratio(rho, phi, fixed, variable, model, base)
                out[f"predicted_steps_{name}"] = predicted_step_ratio(rho, phi, model, base)
        return out


def choose_prompt_count(
    groups: int,
    allowed: list[int],
    rho: float | None,
    fixed: float | None,
    variable: float | None,
    max_step_ratio: float,
    model: str = "adam",
    base: float = 1.0,
) -> PromptCountDecision:
    """The allowed k minimising J(k / groups) subject to S(k/groups)/S(1) ≤ `max_step_ratio` under the step model
    `model` (``"adam"`` or ``"sgd"``, module docstring), with the row stage's noise multiplier `base` (1 + w I:
    `predicted_step_ratio`);
    every group (k = groups, `fallback`) when ρ is missing or not a finite number > 0, or `fixed` or `variable` is
    missing or not a finite number ≥ 0, or fixed + variable is 0. Ties go to the larger k."""
    usable = (
        rho is not None
        and math.isfinite(rho)
        and rho > 0
        and fixed is not None
        and variable is not None
        and math.isfinite(fixed)
        and math.isfinite(variable)
        and fixed >= 0
        and variable >= 0
        and fixed + variable > 0
    )
    if not usable:
        return PromptCountDecision(groups, 1.0, 1.0, 1.0, True)
    best = None
    for k in sorted(set(allowed) | {groups}, reverse=True):
        phi = k / groups
        steps = predicted_step_ratio(rho, phi, model, base)
        if steps > max_step_ratio * (1 + 1e-12) and k != groups:
            continue
        cost = predicted_compute_ratio(rho, phi, fixed, variable, model, base)
        if best is None or cost < best.compute_ratio - 1e-12:
            best = PromptCountDecision(k, phi, steps, cost, False)
    return best


class StepCostFit:
    """Exponentially weighted least squares of a batch's generation seconds y on its generated tokens x: y ≈ a + b x
    (a: the per-step part, b: seconds per generated token), decay `decay` per batch.

    With Σ over batches of weights w_t = decay^(age): x̄ = Σ w x / Σ w, ȳ alike, b = Σ w (x − x̄)(y − ȳ) / Σ w (x − x̄)²,
    a = ȳ − b x̄. The intercept is identifiable only when the batches' x differ: while the weighted spread of x is
    below `min_spread` of its mean (e.g. every batch the same size), the fit is through the origin (a = 0,
    b = ȳ / x̄: every second scales with the tokens). A negative a or b is clamped to 0 (refitting the other term
    alone)."""

    def __init__(self, decay: float = 0.9, min_spread: float = 0.1):
        self.decay, self.min_spread = decay, min_spread
        self.sums = [0.0] * 5  # Σw, Σwx, Σwy, Σwx², Σwxy

    def update(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y) and x > 0 and y >= 0):
            return
        d = self.decay
        self.sums = [d * s + v for s, v in zip(self.sums, (1.0, x, y, x * x, x * y), strict=True)]

    def identified(self) -> bool:
        """Whether the batches' x differ enough to fit the intercept (the spread is at least `min_spread` of x̄)."""
        w, sx, _, sxx, _ = self.sums
        if w <= 0 or sx <= 0:
            return False
        mx = sx / w
        return max(sxx / w - mx * mx, 0.0) >= (self.min_spread * mx) ** 2

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before any batch."""
        w, sx, sy, sxx, sxy = self.sums
        if w <= 0 or sx <= 0:
            return None
        mx, my = sx / w, sy / w
        var = max(sxx / w - mx * mx, 0.0)
        if not self.identified():
            return 0.0, my / mx
        b = (sxy / w - mx * my) / var
        a = my - b * mx
        if b < 0:
            return my, 0.0
        if a < 0:
            return 0.0, (sxy / w) / (sxx / w)
        return a, b

    def state_dict(self) -> dict:
        return {"sums": list(self.sums)}

    def load_state_dict(self, state: dict) -> None:
        self.sums = [float(v) for v in state["sums"]]


def check_prompt_fields(args) -> float | str:
    """Validates the prompt count's fields of a `CostAwareGRPOConfig` (after TRL's `__post_init__`), with errors
    that name the field and the allowed values; returns `cost_aware_prompt_fraction` parsed (a float in (0, 1] or
    "auto")."""
    try:
        fraction = PromptFraction(args.cost_aware_prompt_fraction)
    except ValueError:
        fraction = None
    if fraction is None or (fraction != AUTO and not (math.isfinite(fraction) and 0.0 < fraction <= 1.0)):
        raise ValueError(
            f"cost_aware_prompt_fraction must be a number in (0, 1] or 'auto', got {args.cost_aware_prompt_fraction!r}"
        )
    ratio = args.cost_aware_max_step_ratio
    if not (isinstance(ratio, int | float) and not isinstance(ratio, bool) and 1.0 <= ratio < math.inf):
        raise ValueError(
            f"cost_aware_max_step_ratio must be a finite number >= 1 (1: never take more steps than the full batch, "
            f"so 'auto' only measures and predicts), got {ratio!r}"
        )
    step_cost = args.cost_aware_generation_step_cost
    if not (isinstance(step_cost, int | float) and not isinstance(step_cost, bool) and 0.0 <= step_cost < math.inf):
        raise ValueError(f"cost_aware_generation_step_cost must be a finite number >= 0, got {step_cost!r}")
    if fraction == 1.0:
        return fraction
    rows, groups = args.per_device_train_batch_size * args.steps_per_generation, args.num_generations
    if rows % groups != 0:
        raise ValueError(
            f"cost_aware_prompt_fraction={fraction!r} needs each rank's generation batch to hold whole groups: "
            f"per_device_train_batch_size x steps_per_generation = {args.per_device_train_batch_size} x "
            f"{args.steps_per_generation} = {rows} must be a multiple of num_generations={groups} (else a prompt's "
            "rollouts are split over ranks and no rank can leave the prompt out alone). Set "
            "cost_aware_prompt_fraction=1.0 or change those fields."
        )
    if args.cost_aware and args.cost_aware_layout == "full":
        raise ValueError(
            f"cost_aware_prompt_fraction={fraction!r} is not supported with cost_aware_layout='full', which sizes the "
            "micro-batches for the whole generation batch; use cost_aware_layout='auto' (packed) or 'even'."
        )
    if fraction != AUTO:
        k_groups = rows // groups
        allowed = allowed_counts(k_groups, groups, args.steps_per_generation)
        if fixed_count(k_groups, fraction, allowed) == k_groups:
            warnings.warn(
                f"cost_aware_prompt_fraction={fraction} rounds to every prompt of the generation batch: {k_groups} "
                f"groups per rank, and the group counts whose rows split into steps_per_generation="
                f"{args.steps_per_generation} equal micro-batches are {allowed}. Nothing is left out.",
                UserWarning,
                stacklevel=4,
            )
    return fraction
