"""What the "compute" rule and the "auto" prompt count measure in the run: the gradient noise scale and each
generation batch's costs (a mixin of `CostAwareGRPOTrainer`; the math is in `compute_budget.py` and `prompt_count.py`).
The measurements run when either rule is on (`cost_aware_kept_fraction="compute"`, `cost_aware_prompt_fraction=
"auto"`, the latter with `cost_aware=False` too), and cost nothing otherwise.

**Noise scale.** At each optimizer step, before clipping, `_observe_gradient` reads the accumulated gradient G_t of
the trainable parameters: |G_t|², and G_t · G_t' with the stored gradient of the latest step of an earlier generation
batch; then it stores G_t (one copy of the gradient in its own dtype, reused in place). It needs no extra forward or
backward, and no float32 copy of a whole parameter (`compute_budget.gradient_terms` reads slices). Where it reads:

- one process, DDP: `param.grad` in `_clip_grad_norm` (or in the pre-optimizer callback when `max_grad_norm` is 0),
  the all-reduced gradient, identical on every rank. Under fp16's GradScaler the gradient read in `_clip_grad_norm` is
  still scaled by the scaler's current scale s (accelerate unscales it inside its `clip_grad_norm_`), so
  |G_t|² = |g_t|² / s_t² and G_t · G_t' = g_t · g_t' / (s_t s_t'), with g the scaled gradients (the stored copy keeps
  its own scale); in the pre-optimizer callback the Trainer has already unscaled it (`_get_grad_norm`).
- DeepSpeed ZeRO-0 and ZeRO-1: accelerate runs the engine's step inside `backward`, so the gradient is read there, at
  the accumulation boundary, before the engine's step (the engine's `step` is wrapped at the start of training):
  ZeRO-0 the all-reduced `param.grad`; ZeRO-1 this rank's partition of the averaged gradient (the ZeRO optimizer's
  `averaged_gradients`), whose |·|² and dot product are summed over ranks (one all-reduce of three numbers, with a
  flag that pairs a step only where every rank pairs it). DeepSpeed's fp16 loss scale is divided out as above.
- ZeRO-2/3 and FSDP keep gradients in shards outside `param.grad`: the estimator is off and the rule falls back to the
  δ rule ("auto"), with a warning at construction.

A step whose gradient is not finite (an fp16 overflow: the scaler skips that step) is neither counted nor stored.

**At the full batch.** A generation batch that generated for a fraction φ_t of its prompts (`cost_aware_prompt_
fraction`) has 1/φ_t times the full batch's noise, so its step enters the noise scale with the inflation
(1 + I_t)/φ_t − 1: ρ (`_noise`) is always the full generation batch's (`_full_batch_rho`); the "compute" rule gets
ρ/φ_t, the noise-to-signal of the batch it draws rows from.

**Costs** (`cost_aware_cost_model="time"`). A window runs from the start of one generation batch's generation to the
start of the next. Its fixed cost is the generation and scoring (`_generate_and_score_completions`) plus every
optimizer step in it; its update cost is the time in `training_step` less the generation inside it (forward,
backward, the deferred old-policy and reference passes), over the kept policy tokens of the batch. Both are averaged
over windows (`NOISE_EMA`) and per rank. (Under DeepSpeed the engine's optimizer step runs inside
`backward`, so its time counts in the update cost.) On CUDA each timestamp synchronises the device first (two
synchronisations per micro-step, around `training_step`, and two per generation batch and per optimizer step), so that
asynchronous kernels are counted in the phase that launched them. Evaluation, logging and checkpoints fall outside
every timed phase. Until a window has been timed the rule uses the token model.

For the prompt count, each closed window also feeds `prompt_count.StepCostFit` (generation seconds against the
batch's generated tokens: a per-step and a per-token term), the optimizer seconds, and the generated and kept policy
tokens scaled to the full batch (x_t/φ_t, P_t/φ_t).

**Checkpoints** (`_compute_state`, `_load_compute_state`): the noise scale's and the costs' averages, the step's
inflation and rows, and the window of the latest generation batch when its micro-steps are all done (it closes at the
next generation, after the resume). The stored gradient is not saved (it is a full copy of the gradient, per rank):
the first optimizer step after a resume has no pair, the next one pairs with it, and the averages go on from their
saved values.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
from transformers import TrainerCallback

from .budget import COMPUTE
from .compute_budget import ComputeSignal, Ema, NoiseScale, gradient_terms, rows_per_optimizer_step
from .prompt_count import AUTO, MIN_NOISE_PAIRS, StepCostFit, step_model_for

# Where the estimator reads the gradient (`gradient_source`).
PARAM_GRAD, ZERO0, ZERO1 = "param.grad", "zero0", "zero1"


def gradient_source(deepspeed_stage: int | None, fsdp: bool) -> str | None:
    """Where the noise scale reads the step's gradient (module docstring): `PARAM_GRAD` (one process, DDP), `ZERO0`
    / `ZERO1` (DeepSpeed ZeRO-0/1, at the engine's step), None where it cannot (ZeRO-2/3, FSDP: sharded outside
    `param.grad`). `deepspeed_stage` None: DeepSpeed is off."""
    if fsdp:
        return None
    if deepspeed_stage is None:
        return PARAM_GRAD
    return {0: ZERO0, 1: ZERO1}.get(int(deepspeed_stage))


class _OptimizerTimer(TrainerCallback):
    """Times each optimizer step (fixed cost), and reads the gradient there when `_clip_grad_norm` does not run (the
    Trainer's `_get_grad_norm` has unscaled it by then); under DeepSpeed ZeRO-0/1, wraps the engine's step at the
    start of training to read the gradient there."""

    def __init__(self, trainer):
        self.trainer, self.start = trainer, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._attach_engine_reader()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        t = self.trainer
        if not args.max_grad_norm or args.max_grad_norm <= 0:
            t._observe_gradient(t.model_wrapped, scaled=False)
        self.start = t._clock()

    def on_optimizer_step(self, args, state, control, **kwargs):
        t = self.trainer
        if self.start is not None and t._window is not None:
            t._window["optimizer"] += t._clock() - self.start
        self.start = None


# Decay of the moving averages of the noise scale's two terms and of the measured step costs (a constant: no benchmark
# varied it; it was the field `cost_aware_noise_ema` until issue 38's audit).
NOISE_EMA = 0.9


class ComputeSignals:
    """The "compute" rule's measurements; mixed into `CostAwareGRPOTrainer` before `GRPOTrainer`."""

    def _init_compute_signals(self):
        args = self.args
        self._compute_rule = bool(args.cost_aware) and args.cost_aware_kept_fraction == COMPUTE
        # Whether the run measures the noise scale and its costs: either rule needs them.
        self._signals_on = self._compute_rule or args.cost_aware_prompt_fraction == AUTO
        decay = NOISE_EMA
        self._noise = NoiseScale(decay)
        self._fixed_cost, self._token_cost = Ema(decay), Ema(decay)
        # The prompt count's costs (module docstring): generation seconds against generated tokens, optimizer seconds,
        # and the batch's generated and kept policy tokens scaled to the full batch.
        self._generation_fit = StepCostFit(decay)
        self._optimizer_cost, self._generated_full, self._policy_full = Ema(decay), Ema(decay), Ema(decay)
        self._batch_fraction = 1.0  # φ of the generation batch being trained on
        stage = None
        if self.is_deepspeed_enabled:
            stage = int(getattr(self.accelerator.state.deepspeed_plugin, "zero_stage", 0) or 0)
        self._gradient_source = gradient_source(stage, self.is_fsdp_enabled)
        self._noise_available = self._gradient_source is not None
        self._previous_grad, self._previous_generation, self._previous_scale = None, None, 1.0
        self._generation_index = 0
        self._observed_step = -1
        self._window = None
        self._step_inflation, self._step_rows = 0.0, 0.0
        if not self._signals_on:
            return
        self.add_callback(_OptimizerTimer(self))
        if not self._noise_available and self._compute_rule:
            warnings.warn(
                "cost_aware_kept_fraction='compute' cannot read the gradient under DeepSpeed ZeRO-2/3 or FSDP (it "
                "is sharded outside param.grad), so the gradient noise scale is not measured: every generation batch "
                f"uses the 'auto' rule (variance inflation at most "
                f"cost_aware_budget_delta={args.cost_aware_budget_delta}).",
                UserWarning,
                stacklevel=3,
            )
        if not self._noise_available and args.cost_aware_prompt_fraction == AUTO:
            warnings.warn(
                "cost_aware_prompt_fraction='auto' cannot read the gradient under DeepSpeed ZeRO-2/3 or FSDP (it is "
                "sharded outside param.grad), so the gradient noise scale is not measured: every generation batch "
                "generates for all of its prompts (today's behaviour; cost_aware/prompt_rule_fallback = 1).",
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
        if not self._signals_on:
            return 0.0
        now = self._clock()
        self._close_window()
        self._window = {"generation": 0.0, "optimizer": 0.0, "train": 0.0, "tokens": 0.0, "generated": 0.0}
        return now

    def _note_probe(self, seconds: float):
        """The noise probe's seconds (`noise_probe.py`), counted in the open window's fixed cost with the optimizer
        step (a cost that does not scale with the kept tokens; the prompt count's A), so the rules pay for it."""
        if self._signals_on and self._window is not None and seconds > 0:
            self._window["optimizer"] += seconds

    def _end_generation(self, start: float):
        if self._signals_on and self._window is not None:
            self._window["generation"] = self._clock() - start

    def _note_generation(self, generated: float, policy: float, rows: float):
        """This rank's generated tokens and policy tokens per pass (kept rows) of the open window's batch, and the
        generation batch's rows (all ranks) for the noise scale's per-row metric."""
        if not self._signals_on:
            return
        if self._window is not None:
            self._window["generated"] = float(generated)
            self._window["tokens"] = float(policy)
        args = self.args
        self._step_rows = rows_per_optimizer_step(rows, args.steps_per_generation, args.gradient_accumulation_steps)

    def _close_window(self):
        w, self._window = self._window, None
        if w is None or w["tokens"] <= 0:
            return
        fixed = w["generation"] + w["optimizer"]
        update = max(w["train"] - w["generation"], 0.0)
        self._fixed_cost.update(fixed)
        self._token_cost.update(update / w["tokens"])
        phi = w.get("fraction", 1.0)
        generated = w.get("generated", 0.0)
        self._generation_fit.update(generated, w["generation"])
        self._optimizer_cost.update(w["optimizer"])
        if generated > 0:
            self._generated_full.update(generated / phi)
        self._policy_full.update(w["tokens"] / phi)
        metrics = self._metrics["train"]
        metrics["cost_aware/time_fixed_s"].append(fixed)
        metrics["cost_aware/time_update_s"].append(update)

    def training_step(self, *args, **kwargs):
        if not self._signals_on:  # (the model is put in training mode inside the first call)
            return super().training_step(*args, **kwargs)
        start = self._clock()
        loss = super().training_step(*args, **kwargs)
        if self._window is not None:  # the window open at the end: it holds the generation this step may have run
            self._window["train"] += self._clock() - start
        return loss

    def _note_plan(self, plan, rows):
        """After the plan: this rank's kept policy tokens (per pass) for the window, the step's predicted inflation
        and its rows (all ranks) for the noise scale."""
        if not self._signals_on:
            return
        tokens = float((rows.prompt_tokens + rows.completion_tokens)[plan.indices].sum())
        self._note_generation(float(rows.generated_tokens.sum()), tokens, plan.totals["rows"])
        inflation = plan.metrics.get("budget_inflation", 0.0)
        self._step_inflation = inflation if 0.0 <= inflation < math.inf else 0.0

    def _compute_signal(self) -> ComputeSignal | None:
        if not self._compute_rule:
            return None
        args = self.args
        rho = self._full_batch_rho()
        if rho is not None:
            rho = rho / self._batch_fraction  # the noise-to-signal of the batch the rows are drawn from
        fixed, per_token = None, float(self.num_iterations)
        if args.cost_aware_cost_model == "time" and self._fixed_cost.value is not None:
            fixed, per_token = self._fixed_cost.value, self._token_cost.value
        within = self._probe_within_share()
        return ComputeSignal(
            rho=rho,
            available=self._noise_available or self._probe_on,
            fixed_cost=fixed,
            token_cost=per_token,
            generation_token_cost=args.cost_aware_generation_token_cost,
            within_share=1.0 if within is None else within,
            step_model=step_model_for(args.optim),
        )

    def _full_batch_rho(self) -> float | None:
        """ρ of the full generation batch: the noise probe's once it has `MIN_PROBES` probes (`noise_probe.py`: read
        at one point of the parameters), else the consecutive steps' (module docstring); None before either has an
        estimate."""
        if self._probe_ready():
            return self._probe_rho()
        return self._noise.ratio if self._noise_available else None

    def _noise_estimate_ready(self) -> bool:
        """Whether the rules have a noise estimate to act on: `MIN_PROBES` probes, or `MIN_NOISE_PAIRS` pairs of
        consecutive steps where the gradient can be read."""
        return self._probe_ready() or (self._noise_available and self._noise.count >= MIN_NOISE_PAIRS)

    def _open_window_fraction(self, fraction: float):
        """The fraction φ of the prompts the open window's batch generated for (and trains on)."""
        self._batch_fraction = float(fraction)
        if self._window is not None:
            self._window["fraction"] = float(fraction)

    # ------------------------------------------------------------------ gradient noise scale
    def _grad_scaler_scale(self) -> float:
        """The current scale of accelerate's GradScaler (fp16 mixed precision), 1.0 without one."""
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return 1.0
        return float(scaler.get_scale())

    def _observe_gradient(self, model, scaled: bool = True):
        """One optimizer step's |G_t|² and G_t · G_t' from `param.grad` (module docstring); updates the noise scale
        and logs it. `scaled`: the gradient may still carry the GradScaler's scale (the call in `_clip_grad_norm`,
        before accelerate unscales); False where it was unscaled already. Under DeepSpeed the engine's step reads
        (`_attach_engine_reader`) and this does nothing."""
        if not (self._signals_on and self._gradient_source == PARAM_GRAD and self.model.training):
            return
        if self._observed_step == self.state.global_step:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        self._observed_step = self.state.global_step
        self._record_gradient(grads, self._grad_scaler_scale() if scaled else 1.0)

    def _attach_engine_reader(self):
        """DeepSpeed ZeRO-0/1 (`gradient_source`): wraps the engine's `step` so that, at each accumulation boundary,
        the gradient is read before the engine steps and clears it (accelerate calls the step inside `backward`)."""
        if not (self._signals_on and self._gradient_source in (ZERO0, ZERO1)):
            return
        engine = self.model_wrapped
        if getattr(engine, "_cost_aware_reader", False) or not hasattr(engine, "step"):
            return
        step = engine.step

        def read_then_step(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                self._observe_engine_gradient(engine)
            return step(*args, **kwargs)

        engine.step = read_then_step
        engine._cost_aware_reader = True

    def _observe_engine_gradient(self, engine):
        """The step's gradient under DeepSpeed (module docstring): ZeRO-0 `param.grad`, ZeRO-1 this rank's partition
        of the averaged gradient (summed over ranks; a rank whose partition is empty adds 0); DeepSpeed's fp16 loss
        scale divided out. Where DeepSpeed keeps the gradient elsewhere (e.g. ZeRO-1 with offload: no
        `averaged_gradients`; the same on every rank), warns once and falls back to the δ rule."""
        if not (self._noise_available and self.model.training) or self._observed_step == self.state.global_step:
            return
        self._observed_step = self.state.global_step
        optimizer = engine.optimizer
        if self._gradient_source == ZERO0:
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            readable = bool(grads)
        else:
            partitions = getattr(optimizer, "averaged_gradients", None)
            readable = isinstance(partitions, dict) and bool(partitions)
            grads = (
                [g for key in sorted(partitions) for g in (partitions[key] or []) if g is not None] if readable else []
            )
        if not readable:
            self._noise_available = False
            warnings.warn(
                f"cost_aware_kept_fraction='compute': no gradient readable at the DeepSpeed engine's step "
                f"({self._gradient_source}, {type(optimizer).__name__}); the gradient noise scale is not measured and "
                "every later generation batch uses the 'auto' rule.",
                UserWarning,
                stacklevel=2,
            )
            return
        scale = 1.0
        if engine.fp16_enabled():
            scale = float(getattr(optimizer, "loss_scale", None) or 1.0)
        if self._gradient_source == ZERO0:
            self._record_gradient(grads, scale)
        else:
            group = getattr(optimizer, "dp_process_group", None)
            self._record_gradient(grads, scale, reduce_group=group, device=engine.device)

    def _record_gradient(self, grads, scale: float, reduce_group=False, device=None):
        """|G_t|² and G_t · G_t' of the gradient tensors `grads` (scaled by `scale`; the stored copy carries its own),
        summed over the ranks of `reduce_group` unless it is False (None: the default group; `grads` may then be empty
        on a rank, whose terms are 0 on `device`, and the step is paired only where every rank pairs it), then the
        stored copy, the noise scale and the metrics. A non-finite |G_t|² (an overflowing fp16 step, which the scaler
        skips) changes nothing."""
        previous = self._previous_grad
        paired = (
            previous is not None
            and self._previous_generation != self._generation_index
            and len(previous) == len(grads)
            and all(h.shape == g.shape for g, h in zip(grads, previous, strict=True))
        )
        if grads:
            square, dot = gradient_terms(grads, previous if paired else None)
        else:
            square, dot = torch.zeros((), dtype=torch.float32, device=device), None
        zero = torch.zeros_like(square)
        terms = torch.stack([square, dot if dot is not None else zero, zero + float(paired)])
        ranks = 1
        if reduce_group is not False:
            torch.distributed.all_reduce(terms, group=reduce_group)
            ranks = torch.distributed.get_world_size(reduce_group)
        raw_square, raw_dot, pairs = terms.cpu().tolist()
        paired = paired and pairs == ranks
        grad_sq = raw_square / scale**2
        if not math.isfinite(grad_sq):
            return
        grad_dot = raw_dot / (scale * self._previous_scale) if paired else math.nan
        if paired:
            if grads:
                torch._foreach_copy_(previous, [g.detach() for g in grads])
        else:
            self._previous_grad = [g.detach().clone() for g in grads]
        self._previous_generation, self._previous_scale = self._generation_index, scale
        metrics = self._metrics["train"]
        metrics["cost_aware/noise_grad_sq"].append(grad_sq)
        if not paired:
            return
        # normalised to the full generation batch: a φ-fraction of the prompts has 1/φ times its noise
        self._noise.update(grad_sq, grad_dot, (1.0 + self._step_inflation) / self._batch_fraction - 1.0)
        metrics["cost_aware/noise_grad_dot"].append(grad_dot)
        ratio = self._noise.ratio
        if ratio is not None and math.isfinite(ratio):
            metrics["cost_aware/noise_to_signal"].append(ratio)
            metrics["cost_aware/noise_scale"].append(ratio * self._step_rows)

    def _compute_state(self) -> dict:
        """What a checkpoint keeps (module docstring): not the stored gradient; the window only when its generation
        batch's micro-steps are all done (`_step` a multiple of steps_per_generation × num_iterations), since a
        resume from inside a batch starts a new generation and the window's train time would be partial."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        complete = self._window is not None and getattr(self, "_step", 0) % generate_every == 0
        return {
            "noise": self._noise.state_dict(),
            "fixed_cost": [self._fixed_cost.total, self._fixed_cost.weight],
            "token_cost": [self._token_cost.total, self._token_cost.weight],
            "window": dict(self._window) if complete else None,
            "step": [self._step_inflation, self._step_rows],
            "generation_fit": self._generation_fit.state_dict(),
            "prompt_costs": [[e.total, e.weight] for e in self._prompt_emas()],
            "batch_fraction": self._batch_fraction,
        }

    def _prompt_emas(self) -> tuple[Ema, Ema, Ema]:
        return self._optimizer_cost, self._generated_full, self._policy_full

    def _load_compute_state(self, state: dict):
        self._noise.load_state_dict(state["noise"])
        self._fixed_cost.total, self._fixed_cost.weight = state["fixed_cost"]
        self._token_cost.total, self._token_cost.weight = state["token_cost"]
        window = state.get("window")
        self._window = dict(window) if window is not None else None
        if "step" in state:
            self._step_inflation, self._step_rows = (float(v) for v in state["step"])
        if "generation_fit" in state:
            self._generation_fit.load_state_dict(state["generation_fit"])
            for ema, (total, weight) in zip(self._prompt_emas(), state["prompt_costs"], strict=True):
                ema.total, ema.weight = float(total), float(weight)
            self._batch_fraction = float(state["batch_fraction"])
        # The stored gradient is not in the checkpoint: the next step starts the lag again (module docstring).
        self._previous_grad, self._previous_generation, self._previous_scale = None, None, 1.0
