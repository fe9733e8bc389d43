"""`CostAwareGRPOConfig`: `GRPOConfig` plus the fields of Cost-Aware GRPO."""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from trl import GRPOConfig

from ._compat import check_trl_version
from .rows.layout import layout_for, sampling_floor_warning
from .rows.plan import check_loss_type
from .rows.sampling import COST_KINDS, PROXIES, WEIGHT_NORMALIZATIONS

check_trl_version()  # the package imports this module on first use of the config or the trainer


def resolve_cost_fn(spec) -> Callable | None:
    """The user's cost callable for `cost_aware_cost`, or None for a built-in kind.

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


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class CostAwareGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`CostAwareGRPOTrainer`].

    Inherits every parameter of [`trl.GRPOConfig`] and adds those of Cost-Aware GRPO (Mohri, Globerson, Kaplan, Koren,
    Mansour, "Cost-Aware Learning", arXiv 2604.28020): after each generation batch is scored, only a sample of its rows
    is used for the policy update, drawn with probability ∝ G_i / √c_i (a gradient-norm proxy over the square root of
    the row's token cost) and importance-weighted so that the policy term of the loss stays an unbiased estimate of
    the full-batch GRPO policy term, for every supported `loss_type`.

    Parameters:
        > Parameters that control which rows are trained on

        cost_aware (`bool`, *optional*, defaults to `True`):
            Train on a cost-aware sample of each generation batch. `False`: exactly `GRPOTrainer`'s training, with the
            same token counters and tracking (the baseline arm of a comparison).
        cost_aware_kept_fraction (`float`, *optional*, defaults to `0.5`):
            Fraction m/N in (0, 1] of each rank's generation batch kept for the policy update, rounded down to the
            layout's unit (at least one row per optimizer step; a warning names the fields when the shape keeps more).
        cost_aware_token_budget (`int` or `None`, *optional*, defaults to `None`):
            If set, replaces `cost_aware_kept_fraction`: policy-update tokens (in units of `cost_aware_cost`) per rank
            per generation batch. m is the largest count whose expected kept cost Σ π_i(m) c_i (the systematic draw's,
            exactly, fillers included) is at most the budget, smallest over ranks: each rank keeps at most the budget
            in expectation, unless a single row already exceeds it (then one row, or the layout's unit).
        cost_aware_proxy (`str`, *optional*, defaults to `"loss_aware"`):
            The gradient-norm proxy G_i the draw uses, p_i ∝ G_i / √c_i: `"loss_aware"` (|A_i| · h_i, h_i from the
            loss type's normaliser and the row's loss tokens, weighted by the sampled tokens' confidence when the
            generator returns their log-probabilities), `"advantage"` (|A_i|, the paper's) or `"uniform"` (every row
            that can carry gradient alike: uniform subsampling, the arm to compare against).
        cost_aware_cost (`str` or callable, *optional*, defaults to `"prompt_completion"`):
            Row cost c_i: `"prompt_completion"` (non-padding prompt + completion tokens), `"completion"`, a callable
            `fn(prompt_mask, completion_mask) -> Tensor[N]` (e.g. a FLOPs model), or an import path
            `"module:function"` naming one.
        cost_aware_smoothing (`float`, *optional*, defaults to `0.1`):
            Uniform smoothing α in [0, 1] over the rows that can carry gradient S: p = (1 − α) q + α/|S| on S. Bounds
            those rows' weights by |S|/(α N) ≤ 1/α.

        > Parameters that control the importance weights

        cost_aware_weight_normalization (`str`, *optional*, defaults to `"none"`):
            `"none"`: Horvitz–Thompson weights, exactly unbiased for the policy term. `"recenter"`: w − mean + w̄₀,
            floored at 0 (the mean over the kept rows of all ranks, w̄₀ its expectation under the design): the same
            gradient scale with less spread, biased by O(1/m).

        > Parameters that control the update's forward passes

        shared_prompt_forward (`bool`, *optional*, defaults to `False`):
            Run the rows of a micro-batch that repeat one prompt (a GRPO group) with that prompt once, in the policy,
            old-policy and reference passes: one sequence per group, a 4D attention mask and position ids that give
            every token exactly the context and position of its own row, so log-probs and gradients equal the
            unshared passes' to floating-point rounding; rows are grouped by prompt within each optimizer step where
            that leaves the step's gradient unchanged. Applies with `cost_aware=False` too. Refused at construction
            where it cannot be exact (an attention implementation other than `"sdpa"`/`"eager"`, sliding-window
            attention, a multimodal model, a router aux loss, PEFT prompt learning); a micro-batch it cannot lay out
            (a completion mask with a hole, right-padded prompts) runs unshared, with a warning.

        > Parameters that control tracking

        cost_aware_run_group (`str` or `None`, *optional*, defaults to `None`):
            Name shared by the runs of one comparison (baseline and cost-aware arms, several seeds): the W&B run group
            and a field of the local metrics record. `None`: `$WANDB_RUN_GROUP` if set.
    """

    cost_aware: bool = field(
        default=True,
        metadata={"help": "Train on a cost-aware sample of each generation batch. False: plain GRPO (counters kept)."},
    )
    cost_aware_kept_fraction: float = field(
        default=0.5,
        metadata={
            "help": "Fraction m/N in (0, 1] of each rank's generation batch kept for the policy update (rounded down "
            "to the layout's unit, at least one row per optimizer step)."
        },
    )
    cost_aware_token_budget: int | None = field(
        default=None,
        metadata={
            "help": "If set, replaces cost_aware_kept_fraction: policy-update tokens per rank per generation batch. m "
            "is the largest count whose expected kept tokens (sum of pi_i(m) c_i for the systematic draw, exactly) "
            "stay within the budget, smallest over ranks: at most the budget in expectation unless one row exceeds it."
        },
    )
    cost_aware_proxy: str = field(
        default="loss_aware",
        metadata={
            "help": "Gradient-norm proxy G of the draw p ∝ G/sqrt(c): 'loss_aware' (|A| h, h from the loss type and "
            "the row's length), 'advantage' (|A|, the paper's) or 'uniform' (uniform over the informative rows).",
            "choices": list(PROXIES),
        },
    )
    # `str` though Python may pass a callable: HfArgumentParser/TrlParser call one type per field on the CLI's text.
    cost_aware_cost: str = field(
        default="prompt_completion",
        metadata={
            "help": "Row cost c: 'prompt_completion' (non-padding prompt + completion tokens), 'completion', or an "
            "import path 'module:function' to fn(prompt_mask, completion_mask) -> Tensor[N] (a callable in Python)."
        },
    )
    cost_aware_smoothing: float = field(
        default=0.1,
        metadata={
            "help": "Uniform smoothing alpha in [0, 1] over the rows that can carry gradient S: p = (1 - alpha) q + "
            "alpha / |S| on S. Bounds those rows' weights by 1 / alpha."
        },
    )
    cost_aware_weight_normalization: str = field(
        default="none",
        metadata={
            "help": "'none' (Horvitz-Thompson weights: exactly unbiased for the policy term) or 'recenter' (w - mean "
            "+ w0, floored at 0, mean over the kept rows of all ranks, w0 its expectation: lower spread, biased).",
            "choices": list(WEIGHT_NORMALIZATIONS),
        },
    )
    shared_prompt_forward: bool = field(
        default=False,
        metadata={
            "help": "Run the rows of a micro-batch that share a prompt with that prompt once (policy, old-policy and "
            "reference passes; a 4D mask and per-row position ids: the same log-probs and gradients). Works with "
            "cost_aware=False. Refused where it cannot be exact (attention other than sdpa/eager, sliding window, "
            "multimodal, router aux loss, PEFT prompt learning)."
        },
    )
    cost_aware_run_group: str | None = field(
        default=None,
        metadata={
            "help": "Name shared by the runs of one comparison: the W&B run group and a field of the local metrics "
            "record. None: WANDB_RUN_GROUP if set."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.shared_prompt_forward, bool):
            raise ValueError(f"shared_prompt_forward must be True or False, got {self.shared_prompt_forward!r}")
        fraction = self.cost_aware_kept_fraction
        if not (_number(fraction) and 0.0 < fraction <= 1.0):
            raise ValueError(f"cost_aware_kept_fraction must be a number in (0, 1], got {fraction!r}")
        self.cost_aware_kept_fraction = float(fraction)
        budget = self.cost_aware_token_budget
        if budget is not None:
            if not (_number(budget) and float(budget).is_integer() and budget >= 1):
                raise ValueError(
                    "cost_aware_token_budget must be a whole number of tokens >= 1 (per rank per generation batch) "
                    f"or None, got {budget!r}"
                )
            self.cost_aware_token_budget = int(budget)
        if self.cost_aware_proxy not in PROXIES:
            raise ValueError(f"cost_aware_proxy must be one of {PROXIES}, got {self.cost_aware_proxy!r}")
        resolve_cost_fn(self.cost_aware_cost)  # raises with the allowed values
        if not (_number(self.cost_aware_smoothing) and 0.0 <= self.cost_aware_smoothing <= 1.0):
            raise ValueError(f"cost_aware_smoothing must be a number in [0, 1], got {self.cost_aware_smoothing!r}")
        if self.cost_aware_weight_normalization not in WEIGHT_NORMALIZATIONS:
            raise ValueError(
                f"cost_aware_weight_normalization must be one of {WEIGHT_NORMALIZATIONS}, "
                f"got {self.cost_aware_weight_normalization!r}"
            )
        if not self.cost_aware:
            return
        check_loss_type(self.loss_type)  # a ValueError naming loss_type and the supported ones, before any load
        if self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"top_entropy_quantile={self.top_entropy_quantile} is not supported with cost_aware=True: TRL's "
                "entropy threshold is a quantile over the micro-batch's tokens, which sampling changes, so the "
                "cost-aware loss would be biased. Use top_entropy_quantile=1.0 or cost_aware=False."
            )
        warning = sampling_floor_warning(
            layout_for(self),
            self.per_device_train_batch_size,
            self.steps_per_generation,
            self.gradient_accumulation_steps,
            None if self.cost_aware_token_budget is not None else self.cost_aware_kept_fraction,
        )
        if warning is not None:
            warnings.warn(warning, UserWarning, stacklevel=3)
