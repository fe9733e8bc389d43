"""`CostAwareGRPOConfig`: `GRPOConfig` plus the fields of Cost-Aware GRPO."""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from trl import GRPOConfig

from ._compat import check_trl_version
from .core.sampling import COST_KINDS, DRAW_SCHEMES, PROXIES, WEIGHT_NORMALIZATIONS
from .kept_count.budget import RULES, KeptFraction
from .kept_count.compute_budget import COST_MODELS
from .kept_count.prompt_count import PromptFraction, check_prompt_fields
from .rows.layout import LAYOUTS, full_micro_batch_layout, layout_of, sampling_floor_warning
from .rows.plan import check_loss_type

check_trl_version()  # the package imports this module on first use of the config or the trainer

# The kept fraction of an unset `cost_aware_kept_fraction` (without a token budget): BENCHMARKS.md §6 decides it on
# the regime matrix (it passes every cell under every compute split, and is the cheapest under the GPU splits).
DEFAULT_KEPT_FRACTION = 0.5


def resolve_cost_fn(spec) -> Callable | None:
    """Return the user cost callable for `cost_aware_cost`, or None for a built-in kind.

    `spec` is one of `COST_KINDS`, a callable `fn(prompt_mask, completion_mask) -> Tensor[N]`, or an import path
    `"package.module:function"` naming such a callable (usable from YAML and the command line).
    """
    if callable(spec):
        return spec
    if spec in COST_KINDS:
        return None
    if isinstance(spec, str) and ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cost_aware_cost={spec!r}: cannot import {attr!r} from module {module_name!r}") from err
        if not callable(fn):
            raise ValueError(f"cost_aware_cost={spec!r} does not name a callable")
        return fn
    raise ValueError(
        f"cost_aware_cost must be one of {COST_KINDS}, a callable fn(prompt_mask, completion_mask) -> costs, or an "
        f"import path 'module:function'; got {spec!r}"
    )


# The fields issue 38's audit of the config surface removed: each with what replaces it, or why nothing does. A removed
# field is refused with this text (`CostAwareGRPOConfig(...)`, and `--name` on the command line), never ignored.
REMOVED_FIELDS = {
    "cost_aware_full_micro_batches": "use cost_aware_layout='full' (the same layout, now one of the layouts)",
    "cost_aware_group_by_length": "use cost_aware_layout='even_by_length' (length grouping only ever applied to the "
    "even layout; the default packed layout already sorts each optimizer step's rows by length)",
    "cost_aware_seed": "the sampler's random streams are seeded by `seed` (per process and per stream)",
    "cost_aware_weight_floor": "no replacement: 'recenter' weights, the only ones that can go negative, are floored "
    "at 0, and a floor above 0 only added bias; cost_aware_weight_cap bounds the weights from above",
    "cost_aware_noise_scale_factor": "no replacement: it was a calibration constant of the 'compute' rule's response "
    "model, and its one benchmarked value was fitted on the cells that scored it (BENCHMARKS.md section 8); the "
    "rule uses the model as derived",
    "cost_aware_noise_ema": "no replacement: the 'compute' rule's moving averages decay by 0.9 "
    "(trl_costaware.kept_count.step_signals.NOISE_EMA); no benchmark varied it",
}


def removed_fields_message(names) -> str:
    """The error for configs that set removed fields: each name with its replacement."""
    return "; ".join(f"{name} was removed: {REMOVED_FIELDS[name]}" for name in names)


def _is_whole(value) -> bool:
    """An int, or a float with an integral value (YAML may give 4096.0); not a bool, not a string."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _kept_fraction(value) -> float | str:
    """`value` as a kept fraction: "auto" or a float in (0, 1]; a ValueError naming the field otherwise."""
    try:
        fraction = None if isinstance(value, bool) else KeptFraction(value)
    except ValueError:
        fraction = None
    if fraction is None or (fraction not in RULES and not 0.0 < fraction <= 1.0):
        raise ValueError(f"cost_aware_kept_fraction must be a number in (0, 1], 'auto' or 'compute', got {value!r}")
    return fraction


@dataclass
class CostAwareGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`CostAwareGRPOTrainer`].

    Inherits every parameter of [`trl.GRPOConfig`] and adds the fields of Cost-Aware GRPO (Mohri, Globerson, Kaplan,
    Koren, Mansour, "Cost-Aware Learning", arXiv 2604.28020): after each generation batch is scored, only
    `cost_aware_kept_fraction` of its rows are used for the policy update, drawn with probability ∝ |A_i| / √c_i
    (advantage over the square root of the row's token cost), and re-weighted so that the policy term of the loss stays
    an unbiased estimate of the full-batch GRPO policy term (the KL and entropy terms are not re-weighted; see
    docs/algorithm.md).

    The defaults are provisional: they are chosen from the benchmarks in `BENCHMARKS.md` on a tiny model and task,
    and may change as larger runs are measured.

    Parameters:
        cost_aware (`bool`, defaults to `True`):
            Switch. With `False` the trainer behaves exactly like `GRPOTrainer` but still logs the token counters.
        cost_aware_kept_fraction (`float`, `"auto"`, `"compute"` or `None`, defaults to `None`):
            Fraction m/N of each rank's generation batch kept for the policy update, rounded down to the layout's
            unit (at least one row per optimizer step). `None` (unset) means 0.5, or, when `cost_aware_token_budget`
            is set, that the budget alone chooses m. 0.5 is decided on the regime matrix (BENCHMARKS.md §6): it
            reaches the target and ends within 0.01 of GRPO at equal compute in every cell under every compute split,
            and is the cheapest under the GPU splits; `"auto"` is cheaper only under an update-heavy (CPU-like) split
            and fails the variance-limited long cell at generation 55%. `"auto"`: per generation batch, the
            smallest m whose predicted variance inflation over the full batch is at most `cost_aware_budget_delta`
            (docs/budget_and_proxy.md §2); the largest m any rank needs is kept on every rank.
            `"compute"`: per generation batch, the m minimising the predicted cost of the run to its target,
            (1 + ρ (1 + I(m))) (C_fix + κ T(m)), with ρ = B_noise / N the gradient noise scale measured from the run's
            own optimizer steps, C_fix a step's cost that does not shrink with m and κ the price of a kept policy token
            (`trl_costaware/kept_count/compute_budget.py`, docs/budget_and_proxy.md §3; McCandlish et al. 2018, "An
            Empirical Model of Large-Batch Training"). Every row is kept until the noise scale has its first estimate
            (the second optimizer step); under DeepSpeed and FSDP, where the gradient is not readable, it falls back to
            `"auto"`.
        cost_aware_cost_model (`str`, defaults to `"time"`):
            With `"compute"`: `"time"` (the run's measured seconds: generation, scoring and optimizer step as C_fix,
            update seconds per kept policy token as κ; the token model until the first generation batch is timed) or
            `"tokens"` (C_fix = `cost_aware_generation_token_cost` × generated tokens, κ = `num_iterations`).
        cost_aware_generation_token_cost (`float`, defaults to `1.2`):
            The token model's price of a generated token, in policy-update tokens. 1.2: verl's Qwen3-8B GRPO step
            (generation 55%, passes and update 45%) with completions much longer than prompts.
        cost_aware_budget_delta (`float`, defaults to `1.0`):
            With `cost_aware_kept_fraction="auto"`: the allowed variance inflation δ ≥ 0 of the update relative to
            training on the whole generation batch (0: keep every informative row; 1: the update may be twice as
            noisy as the full batch's).
        cost_aware_token_budget (`int` or `None`, defaults to `None`):
            If set (a whole number >= 1), replaces the kept fraction: each generation batch keeps as many rows as the
            expected token cost of the draw allows (tokens per rank per generation batch); all ranks use the smallest
            such count.
        cost_aware_proxy (`str`, defaults to `"advantage"`):
            Sampling score: `"advantage"` (|A|/√c, the method), `"loss_aware"` (|A|·h/√c, h from the loss type's
            normaliser and the row's length, docs/budget_and_proxy.md §1), `"uniform"`, `"inverse_sqrt_cost"` (1/√c),
            `"inverse_cost"` (1/c; an ablation, no gain when gradient norms are equal).
        cost_aware_cost (`str` or callable, defaults to `"prompt_completion"`):
            Row cost c_i: `"prompt_completion"` (non-padding prompt + completion tokens), `"completion"`, a callable
            `fn(prompt_mask, completion_mask) -> Tensor[N]` (e.g. a FLOPs model), or `"module:function"`.
        cost_aware_smoothing (`float`, defaults to `0.1`):
            Uniform smoothing α in [0, 1] over the rows that can carry gradient S: p = (1 − α) q + α/|S| on S. Bounds
            those rows' weights by |S|/(α N) ≤ 1/α.
        cost_aware_draw (`str`, defaults to `"systematic"`):
            `"systematic"` (fixed size, without replacement, Horvitz–Thompson weights) or `"multinomial"` (with
            replacement, Hansen–Hurwitz weights; duplicates are trained twice).
        cost_aware_weight_normalization (`str`, defaults to `"none"`):
            `"none"` (the Horvitz–Thompson weights: exactly unbiased for the policy term), `"recenter"` (w − mean +
            w̄₀, floored at 0: the seeds' "re-centring"), `"self_normalize"` (w · w̄₀ / mean); the
            mean is over the kept rows of all ranks and w̄₀ is its expectation under the design (|S|/N, S the rows that
            can be drawn: `sampling.design_weight_terms`). Both normalisations keep the gradient's scale but are
            biased (a ratio estimator's O(1/m) bias: +1% to +13% along the full-batch gradient, measured in
            docs/algorithm.md §2.5). `"none"` is the default again (it was `"recenter"` from 0a2f1ba on): the 1.06×
            [1.03, 1.10] token advantage that made recentring the default was measured with the old centre 1, which
            scaled the gradient by N/|S|; rerun with the centre w̄₀ (long testbed, `"auto"`, 20 seeds) `"none"` needs
            1.00× [0.99, 1.02] recentring's tokens, end accuracy −0.001 [−0.005, +0.002]: no measured gain left to
            pay a bias for (BENCHMARKS.md §5).
        cost_aware_weight_cap (`float` or `None`, defaults to `None`):
            Upper clamp for the weights (> 0; truncated importance sampling: bounds a row's weight, biased).
            `"recenter"` weights, which can go negative, are floored at 0.
        cost_aware_run_group (`str` or `None`, defaults to `None`):
            Group name shared by the runs of one comparison (W&B group, and a field of the local metrics record).
        cost_aware_layout (`str`, defaults to `"auto"`):
            How the kept rows are cut into micro-batches (docs/layout.md). `"packed"`: per optimizer step, its kept
            rows sorted by length in as few micro-batches of up to `per_device_train_batch_size` rows as they need;
            the step's other micro-steps are no-ops (skipped where that is safe: one process, and DDP's non-syncing
            micro-steps; a 1-token forward/backward with no loss token otherwise), so the update's compute falls
            with the kept rows at every micro-batch size and m need not be a multiple of `steps_per_generation`.
            Same gradient as `"even"` for the same rows (tests/test_packed_layout.py). `"even"`: TRL's split, m/S rows
            in each of the S micro-steps (m a multiple of S: at `per_device_train_batch_size=1` nothing is dropped).
            `"even_by_length"`: `"even"`, with the kept rows of similar length regrouped into the same micro-batch
            (less padding; micro-batch order stays random). `"full"`: the config is rewritten so that the kept rows
            fill full micro-batches, `per_device_train_batch_size` kept rows each and `cost_aware_kept_fraction ×
            gradient_accumulation_steps` of them per optimizer step, with the same generation batch
            (`rows/layout.py`); it needs a fixed kept fraction and then runs `"even"`. `"auto"`: `"packed"`, or
            `"even"` with TRL's entropy bonus or a router aux loss (which packing would re-weight).
        cost_aware_prompt_fraction (`float` or `"auto"`, defaults to `1.0`):
            The share φ of each generation batch's prompts that are generated for (docs/prompt_count.md), with
            `cost_aware=True` or `False`: before generation each rank keeps k of its K_r groups (the same k on every
            rank, drawn uniformly without replacement from the prompts TRL's sampler drew), so the step is GRPO's
            step at φ times the prompts, unbiased, and generation, scoring and update all shrink. 1.0: every prompt
            (TRL's behaviour). A number in (0, 1): k is the count nearest φ K_r whose rows split into
            `steps_per_generation` equal micro-batches. `"auto"`: per generation batch, the k minimising the
            predicted compute to the target, S(φ)(A + φ B) with S(φ) = √(1 + ρ/φ) for Adam-like optimizers
            (1 + ρ/φ for `optim="sgd"`), ρ the full batch's measured gradient noise-to-signal ratio (from the noise
            probe, `cost_aware_noise_probe_every`) and A, B the per-step and per-prompt-share costs fitted from the
            run's own steps, subject to at most `cost_aware_max_step_ratio` times the full batch's steps; every
            prompt until the noise is measured (`trl_costaware/kept_count/prompt_count.py`). Needs
            `per_device_train_batch_size × steps_per_generation` to be a multiple of `num_generations`; not with
            `cost_aware_prompt_sampling` or `cost_aware_layout="full"`. `max_steps`, epochs and the learning-rate
            schedule keep TRL's meaning: a run that should reach GRPO's accuracy needs about the predicted step
            ratio times GRPO's steps.
        cost_aware_max_step_ratio (`float`, defaults to `1.5`):
            With `cost_aware_prompt_fraction="auto"`: the most steps to the target, relative to the full batch's, the
            rule may trade for compute (≥ 1; 1 only measures and logs its predictions).
        cost_aware_generation_step_cost (`float`, defaults to `0.0`):
            With `cost_aware_prompt_fraction="auto"` and `cost_aware_cost_model="tokens"`: a generation batch's cost
            that does not shrink with its prompts (an inference engine's latency floor), in policy-update tokens per
            rank (≥ 0).
        cost_aware_noise_probe_every (`int`, defaults to `8`):
            Where a rule reads the gradient noise (`cost_aware_prompt_fraction="auto"`, `cost_aware_kept_fraction=
            "compute"`): probe the noise of the first 3 training generation batches, then of every this many, at one
            point of the parameters and split into its between-prompt and within-group parts (one extra forward and
            backward over the batch's informative rows per probe; `trl_costaware/kept_count/noise_probe.py`). 0: off
            (the rules read the noise of consecutive optimizer steps).
    """

    cost_aware: bool = field(
        default=True,
        metadata={"help": "Train on a cost-aware sample of each generation batch. False: plain GRPO (counters kept)."},
    )
    cost_aware_kept_fraction: KeptFraction | None = field(
        default=None,
        metadata={
            "help": "Fraction m/N of each rank's generation batch kept for the policy update, rounded down to the "
            "layout's unit (at least one row per optimizer step). In (0, 1], or 'auto': the smallest m "
            "whose predicted variance inflation is at most cost_aware_budget_delta (largest over ranks), or "
            "'compute': the m minimising the predicted cost to the target, (1 + B_noise/N (1 + I(m))) (C_fix + "
            "kappa T(m)), from the run's measured gradient noise scale and step costs (largest over ranks). Unset: "
            "0.5, or the token budget alone when cost_aware_token_budget is set."
        },
    )
    cost_aware_cost_model: str = field(
        default="time",
        metadata={
            "help": "With cost_aware_kept_fraction='compute', what a step costs: 'time' (each generation batch's "
            "measured generation, scoring and optimizer seconds as the fixed cost, its update seconds per kept policy "
            "token as kappa; the token model until the first batch is timed) or 'tokens' (fixed cost = "
            "cost_aware_generation_token_cost x generated tokens, kappa = num_iterations per kept policy token).",
            "choices": list(COST_MODELS),
        },
    )
    cost_aware_generation_token_cost: float = field(
        default=1.2,
        metadata={
            "help": "The token cost model's price of one generated token in policy-update tokens (> 0). 1.2 is "
            "verl's published Qwen3-8B GRPO step (generation 55%%, old/reference passes and update 45%%) with "
            "completions much longer than prompts."
        },
    )
    cost_aware_budget_delta: float = field(
        default=1.0,
        metadata={
            "help": "With cost_aware_kept_fraction='auto': allowed variance inflation delta >= 0 of the update over "
            "training on the whole generation batch (0: every informative row; 1: twice the full batch's noise)."
        },
    )
    cost_aware_token_budget: int | None = field(
        default=None,
        metadata={
            "help": "If set, replaces cost_aware_kept_fraction: tokens per rank per generation batch for the policy "
            "update; the number of kept rows is the budget over the expected cost of a draw (smallest over ranks)."
        },
    )
    cost_aware_proxy: str = field(
        default="advantage",
        metadata={
            "help": "Sampling score: 'advantage' (|A|/sqrt(c), the method), 'loss_aware' (|A| h/sqrt(c), h from the "
            "loss type and the row's length), 'uniform', "
            "'inverse_sqrt_cost' (1/sqrt(c)) or 'inverse_cost' (1/c, an ablation).",
            "choices": list(PROXIES),
        },
    )
    cost_aware_cost: str = field(
        default="prompt_completion",
        metadata={
            "help": "Row cost: 'prompt_completion' (non-padding prompt+completion tokens), 'completion', or an import "
            "path 'module:function' to fn(prompt_mask, completion_mask) -> Tensor[N] (a callable works in Python)."
        },
    )
    cost_aware_smoothing: float = field(
        default=0.1,
        metadata={
            "help": "Uniform smoothing alpha in [0, 1] over the rows that can carry gradient S: p = (1 - alpha) q + "
            "alpha / |S| on S. Bounds those rows' weights by |S| / (alpha N) <= 1 / alpha."
        },
    )
    cost_aware_draw: str = field(
        default="systematic",
        metadata={
            "help": "'systematic' (fixed size without replacement, Horvitz-Thompson weights) or 'multinomial' (with "
            "replacement, Hansen-Hurwitz weights).",
            "choices": list(DRAW_SCHEMES),
        },
    )
    cost_aware_weight_normalization: str = field(
        default="none",
        metadata={
            "help": "'none' (the default: Horvitz-Thompson weights, exactly unbiased for the policy term), "
            "'recenter' (w - mean + w0, floored at 0; biased) or 'self_normalize' (w * w0 / mean; biased); "
            "the mean is over the kept rows of all ranks, w0 its expectation under the design (|S|/N, S the rows "
            "that can be drawn). Measured bias: docs/algorithm.md section 2.5.",
            "choices": list(WEIGHT_NORMALIZATIONS),
        },
    )
    cost_aware_weight_cap: float | None = field(
        default=None,
        metadata={
            "help": "Upper clamp for importance weights (> 0; truncated importance sampling, biased). None: no cap."
        },
    )
    cost_aware_run_group: str | None = field(
        default=None,
        metadata={
            "help": "Name shared by the runs of one comparison (baseline and cost-aware arms, several seeds): the W&B "
            "run group and a field of the local metrics record. None: WANDB_RUN_GROUP if set."
        },
    )
    cost_aware_layout: str = field(
        default="auto",
        metadata={
            "help": "Micro-batch layout of the kept rows: 'packed' (each optimizer step's kept rows, sorted by "
            "length, in as few micro-batches of up to per_device_train_batch_size rows as they need; the other "
            "micro-steps are no-ops), 'even' (TRL's split: m / steps_per_generation rows per micro-step), "
            "'even_by_length' ('even' with rows of similar length grouped, less padding), 'full' (the config "
            "rewritten so that the kept rows fill micro-batches of per_device_train_batch_size rows, "
            "kept_fraction x gradient_accumulation_steps of them per optimizer step; needs a fixed kept fraction) or "
            "'auto' ('packed', or 'even' with an entropy bonus or a router aux loss).",
            "choices": list(LAYOUTS),
        },
    )

    cost_aware_prompt_fraction: PromptFraction = field(
        default=1.0,
        metadata={
            "help": "Share of each generation batch's prompts generated for, with cost_aware True or False: each "
            "rank keeps the same number of its groups, drawn uniformly, so the step is GRPO's at fewer prompts "
            "(unbiased). 1.0: all (TRL's behaviour); a number in (0, 1]; or 'auto': per generation batch, the count "
            "minimising the predicted compute to the target S(phi)(A + phi B), S = sqrt(1 + rho/phi) for Adam-like "
            "optimizers (1 + rho/phi for optim='sgd'), from the run's measured gradient noise and step costs, within "
            "cost_aware_max_step_ratio of the full batch's steps."
        },
    )
    cost_aware_max_step_ratio: float = field(
        default=1.5,
        metadata={
            "help": "With cost_aware_prompt_fraction='auto': the most steps to the target, relative to generating "
            "every prompt, the rule may trade for compute (>= 1; 1 only measures and logs its predictions)."
        },
    )
    cost_aware_generation_step_cost: float = field(
        default=0.0,
        metadata={
            "help": "With cost_aware_prompt_fraction='auto' and cost_aware_cost_model='tokens': a generation batch's "
            "cost that does not shrink with its prompts, in policy-update tokens per rank (>= 0)."
        },
    )

    cost_aware_noise_probe_every: int = field(
        default=8,
        metadata={
            "help": "With cost_aware_prompt_fraction='auto' or cost_aware_kept_fraction='compute': probe the gradient "
            "noise (between prompts and within groups, at one point of the parameters) on the first 3 training "
            "generation batches and then every this many (one extra forward and backward over the informative rows "
            "per probe). 0: off (the noise of consecutive optimizer steps)."
        },
    )

    def __post_init__(self):
        if self.cost_aware and self.cost_aware_layout == "full":
            self._apply_full_micro_batch_layout()  # before TRL derives the generation batch from these fields
        super().__post_init__()
        if self.cost_aware:
            check_loss_type(self.loss_type)  # a ValueError naming loss_type and the supported ones, before any load
        if self.cost_aware and self.top_entropy_quantile < 1.0:
            # TRL takes the entropy threshold over the tokens of the current micro-batch, so a kept row's loss depends
            # on which other rows were drawn: no per-row weight makes that unbiased for the full batch's loss.
            raise ValueError(
                f"top_entropy_quantile={self.top_entropy_quantile} is not supported with cost_aware=True: TRL's "
                "entropy threshold is a quantile over the micro-batch's tokens, which sampling changes, so the "
                "cost-aware loss would be biased. Use top_entropy_quantile=1.0 or cost_aware=False."
            )
        if self.cost_aware_kept_fraction is None:  # unset: the default fraction, unless a token budget alone chooses m
            self.cost_aware_kept_fraction = None if self.cost_aware_token_budget is not None else DEFAULT_KEPT_FRACTION
        else:
            self.cost_aware_kept_fraction = _kept_fraction(self.cost_aware_kept_fraction)
            if self.cost_aware_kept_fraction in RULES and self.cost_aware_token_budget is not None:
                raise ValueError(
                    f"cost_aware_kept_fraction={self.cost_aware_kept_fraction!r} and cost_aware_token_budget both "
                    "choose the kept row count; set one of them "
                    f"(got cost_aware_token_budget={self.cost_aware_token_budget})"
                )
        if self.cost_aware:
            layout = layout_of(self)  # a ValueError naming the fields for a layout that cannot be made equal
            warning = sampling_floor_warning(
                layout,
                self.per_device_train_batch_size,
                self.steps_per_generation,
                self.gradient_accumulation_steps,
                self.cost_aware_kept_fraction,
            )
            if warning is not None:
                warnings.warn(warning, UserWarning, stacklevel=3)
        if not (
            isinstance(self.cost_aware_budget_delta, int | float) and 0.0 <= self.cost_aware_budget_delta < math.inf
        ):
            raise ValueError(
                f"cost_aware_budget_delta must be a finite number >= 0, got {self.cost_aware_budget_delta!r}"
            )
        if self.cost_aware_cost_model not in COST_MODELS:
            raise ValueError(f"cost_aware_cost_model must be one of {COST_MODELS}, got {self.cost_aware_cost_model!r}")
        price = self.cost_aware_generation_token_cost
        if not (isinstance(price, int | float) and not isinstance(price, bool) and 0.0 < price < math.inf):
            raise ValueError(f"cost_aware_generation_token_cost must be a finite number > 0, got {price!r}")
        budget = self.cost_aware_token_budget
        if budget is not None:
            if not _is_whole(budget) or budget < 1:
                raise ValueError(
                    "cost_aware_token_budget must be a whole number of tokens >= 1 (per rank per generation batch) "
                    f"or None, got {budget!r}"
                )
            self.cost_aware_token_budget = int(budget)
        if self.cost_aware_proxy not in PROXIES:
            raise ValueError(f"cost_aware_proxy must be one of {PROXIES}, got {self.cost_aware_proxy!r}")
        resolve_cost_fn(self.cost_aware_cost)  # raises with the allowed values
        if not 0.0 <= self.cost_aware_smoothing <= 1.0:
            raise ValueError(f"cost_aware_smoothing must be in [0, 1], got {self.cost_aware_smoothing}")
        if self.cost_aware_draw not in DRAW_SCHEMES:
            raise ValueError(f"cost_aware_draw must be one of {DRAW_SCHEMES}, got {self.cost_aware_draw!r}")
        if self.cost_aware_weight_normalization not in WEIGHT_NORMALIZATIONS:
            raise ValueError(
                f"cost_aware_weight_normalization must be one of {WEIGHT_NORMALIZATIONS}, "
                f"got {self.cost_aware_weight_normalization!r}"
            )
        # A negative weight would flip the sign of a row's advantage, which is not a reweighting of TRL's clipped
        # surrogate (only positive factors commute with it), so weights are kept non-negative ("recenter" is floored
        # at 0 by the plan).
        cap = self.cost_aware_weight_cap
        if cap is not None and not (isinstance(cap, int | float) and not isinstance(cap, bool) and 0.0 < cap):
            raise ValueError(f"cost_aware_weight_cap must be a number > 0 or None, got {cap!r}")

        self.cost_aware_prompt_fraction = check_prompt_fields(self)
        every = self.cost_aware_noise_probe_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(
                f"cost_aware_noise_probe_every must be an integer >= 0 (0: the noise probe is off), got {every!r}"
            )

    def _apply_full_micro_batch_layout(self):
        fraction = self.cost_aware_kept_fraction
        if fraction is None and self.cost_aware_token_budget is None:
            fraction = DEFAULT_KEPT_FRACTION  # unset: the default fraction
        fraction = None if fraction is None else _kept_fraction(fraction)  # a float, "auto" or "compute"
        if self.cost_aware_token_budget is not None or fraction is None or fraction in RULES:
            raise ValueError(
                "cost_aware_layout='full' needs a fixed cost_aware_kept_fraction (a number, e.g. 0.5, the "
                "default; 'auto' and 'compute' change the kept row count from batch to batch) and no "
                "cost_aware_token_budget: the kept row count must be known when the micro-batches are sized, got "
                f"cost_aware_kept_fraction={self.cost_aware_kept_fraction!r}, "
                f"cost_aware_token_budget={self.cost_aware_token_budget!r}"
            )
        layout = full_micro_batch_layout(
            self.per_device_train_batch_size,
            self.gradient_accumulation_steps,
            self.steps_per_generation,
            fraction,
        )
        self.per_device_train_batch_size = layout.per_device_train_batch_size
        self.gradient_accumulation_steps = layout.gradient_accumulation_steps
        self.steps_per_generation = layout.steps_per_generation


def _refuse_removed_fields(init):
    """Wrap the dataclass `__init__` so that a removed field gets `REMOVED_FIELDS`' text, not a bare TypeError."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        removed = [name for name in kwargs if name in REMOVED_FIELDS]
        if removed:
            raise ValueError(removed_fields_message(removed))
        init(self, *args, **kwargs)

    return __init__


CostAwareGRPOConfig.__init__ = _refuse_removed_fields(CostAwareGRPOConfig.__init__)
