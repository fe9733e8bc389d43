"""The prompt count's trainer mixin (`cost_aware_prompt_fraction`): before each training generation batch is generated,
keeps k of the rank's K_r groups and hands TRL only those. Wiring only; the math is in `prompt_count.py`, the
measurements in `step_signals.py`, the derivation in docs/prompt_count.md.

- A fixed fraction φ: k = the allowed count nearest φ K_r (`prompt_count.fixed_count`), the same on every rank.
- `"auto"`: k from `prompt_count.choose_prompt_count` under the optimizer's step model (`prompt_count.step_model_for`:
  ``"sgd"`` for `optim="sgd"`, else ``"adam"``), on rank 0's measured costs and the full batch's noise-to-signal
  ρ (identical on every rank: the gradient it is read from is all-reduced), broadcast to every rank (one collective of
  one integer per generation batch), so K′ = k × world size is global and every rank's TRL call gathers equal sizes.
  Until the noise probe has `MIN_PROBES` probes (or, with the probe off, the noise scale has `MIN_NOISE_PAIRS` pairs
  of steps), every prompt is generated (the fallback); under the time cost
  model, while the generation-time fit has seen one batch size only, every second of those batches is a probe at
  half the prompts, so that the fit sees two sizes (`cost_aware/prompt_probe`).
- Which groups: a uniform draw without replacement from the rank's own stream (`stream_generator(seed, rank,
  "prompts")`), saved in checkpoints with the trainer's other streams.

The cost of a step at φ = 1, per rank (C(φ) = A + φ B):

- `cost_aware_cost_model="time"`: A = a + the optimizer step's seconds, B = b X + κ P, with a, b the fitted
  per-step and per-token generation seconds, X and P the batch's generated and kept policy tokens at the full batch
  and κ the measured update seconds per kept policy token;
- `"tokens"`: A = `cost_aware_generation_step_cost`, B = `cost_aware_generation_token_cost` X + `num_iterations` P.
"""

from __future__ import annotations

import torch

from ..core.sampling import stream_generator
from .prompt_count import (
    AUTO,
    PromptCountDecision,
    allowed_counts,
    choose_prompt_count,
    draw_groups,
    fixed_count,
    step_model_for,
)

PROMPT_STREAM = "prompts"


class PromptCount:
    """Mixin for `CostAwareGRPOTrainer` (before `ComputeSignals` and `GRPOTrainer` in the bases)."""

    def _init_prompt_count(self):
        args = self.args
        fraction = args.cost_aware_prompt_fraction
        self._prompt_auto = fraction == AUTO
        self._prompt_on = self._prompt_auto or float(fraction) < 1.0
        g = self.num_generations
        self._prompt_groups = (args.per_device_train_batch_size * args.steps_per_generation) // g
        self._prompt_allowed = [self._prompt_groups]
        if self._prompt_on:
            self._prompt_allowed = allowed_counts(self._prompt_groups, g, args.steps_per_generation)
        self._prompt_generator = stream_generator(args.seed, self.accelerator.process_index, PROMPT_STREAM)
        self._prompt_batches = 0  # training generation batches seen (for the probes)
        self._prompt_step_model = step_model_for(args.optim)  # how the steps respond to the batch (prompt_count)

    def _select_prompts(self, inputs: list) -> list:
        """The inputs of the groups this training generation batch generates for (all of them when the field is 1)."""
        if not self._prompt_on:
            self._open_window_fraction(1.0)
            return inputs
        g, groups = self.num_generations, self._prompt_groups
        if len(inputs) != groups * g or any(
            inputs[j * g + r].get("prompt") != inputs[j * g].get("prompt") for j in range(groups) for r in range(g)
        ):
            raise RuntimeError(
                f"cost_aware_prompt_fraction: this rank's generation batch of {len(inputs)} inputs is not "
                f"{groups} groups of num_generations={g} consecutive copies of one prompt, as TRL's RepeatSampler "
                "lays it out (per_device_train_batch_size x steps_per_generation inputs). A custom sampler or "
                "collator changed it; set cost_aware_prompt_fraction=1.0."
            )
        self._prompt_batches += 1
        decision, probe = self._prompt_decision(groups)
        chosen = draw_groups(groups, decision.count, self._prompt_generator)
        self._open_window_fraction(decision.fraction)
        metrics = self._metrics["train"]
        if self._prompt_auto:
            base = self._prompt_base()
            for key, value in decision.metrics(*self._prompt_inputs(), self._prompt_step_model, base).items():
                metrics[f"cost_aware/{key}"].append(value)
            metrics["cost_aware/prompt_probe"].append(float(probe))
        else:
            metrics["cost_aware/prompt_fraction"].append(decision.fraction)
        return [inputs[j * g + r] for j in chosen for r in range(g)]

    def _prompt_inputs(self) -> tuple[float | None, float | None, float | None]:
        """(ρ, A, B) for the rule (module docstring); None where not measured yet (no noise estimate,
        `_noise_estimate_ready`; no closed window)."""
        rho = self._full_batch_rho() if self._noise_estimate_ready() else None
        generated, policy = self._generated_full.value, self._policy_full.value
        if generated is None or policy is None:
            return rho, None, None
        args = self.args
        if args.cost_aware_cost_model == "time":
            fit, optimizer, kappa = self._generation_fit.fit(), self._optimizer_cost.value, self._token_cost.value
            if fit is None or optimizer is None or kappa is None:
                return rho, None, None
            a, b = fit
            return rho, a + optimizer, b * generated + kappa * policy
        fixed = args.cost_aware_generation_step_cost
        return rho, fixed, args.cost_aware_generation_token_cost * generated + self.num_iterations * policy

    def _prompt_base(self) -> float:
        """The noise multiplier of what a step trains on, at every prompt fraction: 1 + w I, with I the row stage's
        latest predicted inflation and w the noise probe's within-group share (`noise_probe.py`); 1 without the row
        stage or before the probe has measured w (the rows then add nothing to the prompt count's model)."""
        within = self._probe_within_share() if self.args.cost_aware else None
        if within is None:
            return 1.0
        return 1.0 + within * max(self._step_inflation, 0.0)

    def _prompt_decision(self, groups: int) -> tuple[PromptCountDecision, bool]:
        """(the decision, whether it is a probe) for this generation batch; k identical on every rank."""
        args = self.args
        if not self._prompt_auto:
            k = fixed_count(groups, float(args.cost_aware_prompt_fraction), self._prompt_allowed)
            return PromptCountDecision(k, k / groups, float("nan"), float("nan"), False), False
        rho, fixed, variable = self._prompt_inputs()
        decision = choose_prompt_count(
            groups,
            self._prompt_allowed,
            rho,
            fixed,
            variable,
            args.cost_aware_max_step_ratio,
            self._prompt_step_model,
            self._prompt_base(),
        )
        probe = False
        if (
            decision.fallback
            and args.cost_aware_cost_model == "time"
            and args.cost_aware_max_step_ratio > 1.0
            and not self._generation_fit.identified()
            and self._prompt_batches % 2 == 0
        ):
            k = fixed_count(groups, 0.5, self._prompt_allowed)
            probe = k < groups
            if probe:
                decision = PromptCountDecision(k, k / groups, float("nan"), float("nan"), True)
        k = self._broadcast_count(decision.count)
        if k != decision.count:  # rank 0 decided otherwise (its own costs): its count, this rank's predictions
            decision = PromptCountDecision(
                k, k / groups, decision.step_ratio, decision.compute_ratio, decision.fallback
            )
        return decision, probe

    def _broadcast_count(self, k: int) -> int:
        """Rank 0's k on every rank (no collective with one process)."""
        if self.accelerator.num_processes == 1:
            return k
        value = torch.tensor([k], dtype=torch.long, device=self.accelerator.device)
        torch.distributed.broadcast(value, src=0)
        return int(value.item())
