"""What the "compute" rule measures in the run: the gradient noise scale and each generation batch's costs (a mixin of
`CostAwareGRPOTrainer`; the math is in `compute_budget.py`).

**Noise scale.** At each optimizer step, before clipping (`_clip_grad_norm`, or the pre-optimizer callback when
`max_grad_norm` is 0), `_observe_gradient` reads the accumulated gradient G_t of the trainable parameters: |G_t|², and
G_t · G_t' with the stored gradient of the latest step of an earlier generation batch; then it stores G_t (one copy of
the gradient, reused in place). It needs no extra forward or backward. Where the gradient is readable after
accumulation and identical on every rank (one process; DDP, whose gradients are all-reduced before the optimizer
step) the estimate is the same on every rank. DeepSpeed and FSDP keep gradients in shards that `param.grad` does not
hold: there the estimator is off and the rule falls back to the δ rule ("auto"), with a warning at construction.

**Costs** (`cost_aware_cost_model="time"`). A window runs from the start of one generation batch's generation to the
start of the next. Its fixed cost is the generation and scoring (`_generate_and_score_completions`) plus every
optimizer step in it; its update cost is the time in `training_step` less the generation inside it (forward,
backward, the deferred old-policy and reference passes), over the kept policy tokens of the batch. Both are averaged
over windows (`cost_aware_noise_ema`) and per rank. On CUDA each timestamp synchronises the device first (a few
synchronisations per generation batch), so that asynchronous kernels are counted in the phase that launched them.
Evaluation, logging and checkpoints fall outside every timed phase. Until a window has been timed the rule uses the
token model.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
from transformers import TrainerCallback

from .budget import COMPUTE
from .compute_budget import ComputeSignal, Ema, NoiseScale, rows_per_optimizer_step


class _OptimizerTimer(TrainerCallback):
    """Times each optimizer step (fixed cost), and reads the gradient there when `_clip_grad_norm` does not run."""

    def __init__(self, trainer):
        self.trainer, self.start = trainer, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        t = self.trainer
        if not args.max_grad_norm or args.max_grad_norm <= 0:
            t._observe_gradient(t.model_wrapped)
        self.start = t._clock()

    def on_optimizer_step(self, args, state, control, **kwargs):
        t = self.trainer
        if self.start is not None and t._window is not None:
            t._window["optimizer"] += t._clock() - self.start
        self.start = None


class ComputeSignals:
    """The "compute" rule's measurements; mixed into `CostAwareGRPOTrainer` before `GRPOTrainer`."""

    def _init_compute_signals(self):
        args = self.args
        self._compute_rule = bool(args.cost_aware) and args.cost_aware_kept_fraction == COMPUTE
        decay = args.cost_aware_noise_ema
        self._noise = NoiseScale(decay)
        self._fixed_cost, self._token_cost = Ema(decay), Ema(decay)
        self._noise_available = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        self._previous_grad, self._previous_generation = None, None
        self._generation_index = 0
        self._observed_step = -1
        self._window = None
        self._step_inflation, self._step_rows = 0.0, 0.0
        if not self._compute_rule:
            return
        self.add_callback(_OptimizerTimer(self))
        if not self._noise_available:
            warnings.warn(
                "cost_aware_kept_fraction='compute' cannot read the gradient under DeepSpeed or FSDP (it is sharded "
                "outside param.grad), so the gradient noise scale is not measured: every generation batch uses the "
                f"'auto' rule (variance inflation at most cost_aware_budget_delta={args.cost_aware_budget_delta}).",
                UserWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ clock and windows
    def _clock(self) -> float:
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)
        return time.perf_counter()

    def _begin_generation(self) -> float:
        """At the start of a training generation batch: closes the previous window, opens a new one."""
        self._generation_index += 1
        if not self._compute_rule:
            return 0.0
        now = self._clock()
        self._close_window()
        self._window = {"generation": 0.0, "optimizer": 0.0, "train": 0.0, "tokens": 0.0}
        return now

    def _end_generation(self, start: float):
        if self._compute_rule and self._window is not None:
            self._window["generation"] = self._clock() - start

    def _close_window(self):
        w, self._window = self._window, None
        if w is None or w["tokens"] <= 0:
            return
        fixed = w["generation"] + w["optimizer"]
        update = max(w["train"] - w["generation"], 0.0)
        self._fixed_cost.update(fixed)
        self._token_cost.update(update / w["tokens"])
        metrics = self._metrics["train"]
        metrics["cost_aware/time_fixed_s"].append(fixed)
        metrics["cost_aware/time_update_s"].append(update)

    def training_step(self, *args, **kwargs):
        if not self._compute_rule:  # (the model is put in training mode inside the first call)
            return super().training_step(*args, **kwargs)
        start = self._clock()
        loss = super().training_step(*args, **kwargs)
        if self._window is not None:  # the window open at the end: it holds the generation this step may have run
            self._window["train"] += self._clock() - start
        return loss

    def _note_plan(self, plan, rows):
        """After the plan: this rank's kept policy tokens (per pass) for the window, the step's predicted inflation
        and its rows (all ranks) for the noise scale."""
        if not self._compute_rule:
            return
        if self._window is not None:
            tokens = float((rows.prompt_tokens + rows.completion_tokens)[plan.indices].sum())
            self._window["tokens"] = tokens
        inflation = plan.metrics.get("budget_inflation", 0.0)
        self._step_inflation = inflation if 0.0 <= inflation < math.inf else 0.0
        args = self.args
        self._step_rows = rows_per_optimizer_step(
            plan.totals["rows"], args.steps_per_generation, args.gradient_accumulation_steps
        )

    def _compute_signal(self) -> ComputeSignal | None:
        if not self._compute_rule:
            return None
        args = self.args
        rho = self._noise.ratio if self._noise_available else None
        if rho is not None:
            rho = rho * args.cost_aware_noise_scale_factor if math.isfinite(rho) else rho
        fixed, per_token = None, float(self.num_iterations)
        if args.cost_aware_cost_model == "time" and self._fixed_cost.value is not None:
            fixed, per_token = self._fixed_cost.value, self._token_cost.value
        return ComputeSignal(
            rho=rho,
            available=self._noise_available,
            fixed_cost=fixed,
            token_cost=per_token,
            generation_token_cost=args.cost_aware_generation_token_cost,
        )

    # ------------------------------------------------------------------ gradient noise scale
    def _observe_gradient(self, model):
        """One optimizer step's |G_t|² and G_t · G_t' (module docstring); updates the noise scale and logs it."""
        if not (self._compute_rule and self._noise_available and self.model.training):
            return
        if self._observed_step == self.state.global_step:
            return
        self._observed_step = self.state.global_step
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        square = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        paired = self._previous_grad is not None and self._previous_generation != self._generation_index
        if paired:
            dot = torch.stack([(g.float() * h.float()).sum() for g, h in zip(grads, self._previous_grad, strict=True)])
            values = torch.stack([square, dot.sum()]).cpu().tolist()
        else:
            values = [float(square), math.nan]
        if self._previous_grad is None:
            self._previous_grad = [g.detach().clone() for g in grads]
        else:
            torch._foreach_copy_(self._previous_grad, [g.detach() for g in grads])
        self._previous_generation = self._generation_index
        metrics = self._metrics["train"]
        metrics["cost_aware/noise_grad_sq"].append(values[0])
        if not paired:
            return
        self._noise.update(values[0], values[1], self._step_inflation)
        metrics["cost_aware/noise_grad_dot"].append(values[1])
        ratio = self._noise.ratio
        if ratio is not None and math.isfinite(ratio):
            metrics["cost_aware/noise_to_signal"].append(ratio)
            metrics["cost_aware/noise_scale"].append(ratio * self._step_rows)

    def _compute_state(self) -> dict:
        return {
            "noise": self._noise.state_dict(),
            "fixed_cost": [self._fixed_cost.total, self._fixed_cost.weight],
            "token_cost": [self._token_cost.total, self._token_cost.weight],
        }

    def _load_compute_state(self, state: dict):
        self._noise.load_state_dict(state["noise"])
        self._fixed_cost.total, self._fixed_cost.weight = state["fixed_cost"]
        self._token_cost.total, self._token_cost.weight = state["token_cost"]
