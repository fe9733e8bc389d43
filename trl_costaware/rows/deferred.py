"""The deferred no-grad log-prob passes of `CostAwareGRPOTrainer` (a mixin of its methods).

While TRL scores a generation batch, its old-policy and reference passes are replaced by a placeholder; they run
afterwards on the kept micro-batches only, and with vLLM's importance-sampling correction the ratio (and TRL's five
vLLM metrics) is formed from them over the kept rows. The reference-model branch of `_compute_deferred_logps` mirrors
TRL's (`GRPOTrainer._generate_and_score_completions`, which has no helper for it).

The methods run on a `CostAwareGRPOTrainer`: they read TRL's attributes (`args`, `beta`, `use_vllm`, `ref_model`, ...)
and the trainer's `_loss_mask`, `_metrics` and `_cost_aware_totals`.
"""

from __future__ import annotations

import inspect
import math
import sys
from contextlib import contextmanager, nullcontext

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from .plan import float64_bits, to_float64
from .vllm_ratio import combine_ratio_stats, vllm_importance_sampling_ratio, vllm_metrics

# The code object of TRL's scoring function: its direct calls to `_get_per_token_logps_and_entropies` are the passes
# that are deferred.
TRL_SCORING_CODE = inspect.unwrap(GRPOTrainer._generate_and_score_completions).__code__

# Entries of TRL's scored batch that the cost-aware trainer recomputes per kept micro-batch (placeholders until then).
DEFERRED_KEYS = ("old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio")
# TRL's vLLM metrics, computed from its old-policy pass (deferred here): replaced by their values over the kept rows.
VLLM_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


class DeferredLogProbPasses:
    """The deferred passes and the vLLM ratio on kept rows; mixed into `CostAwareGRPOTrainer` before `GRPOTrainer`."""

    @contextmanager
    def _deferred_log_prob_passes(self):
        """While TRL scores a generation batch, its no-grad log-prob passes (old policy, reference) return a NaN
        placeholder instead of running: they run afterwards on the kept rows only (`_compute_deferred_logps`). With
        the vLLM importance-sampling correction, TRL forms its ratio from the placeholder: NaN differences count as 0
        there, so that ratio is 1 and cheap; it is dropped and formed again per kept micro-batch.

        Only TRL's own calls get the placeholder: those made directly from the body of
        `GRPOTrainer._generate_and_score_completions` (the caller's code object is checked). Anything else that runs
        meanwhile (reward functions, `rollout_func`, an environment) and calls `_get_per_token_logps_and_entropies`
        gets the real pass. Should TRL move its passes into a helper, they would simply run (correct, not deferred):
        tests/test_trainer.py::test_dropped_rows_never_reach_a_forward would then fail."""
        saved = vars(self).get("_get_per_token_logps_and_entropies")
        real = self._get_per_token_logps_and_entropies  # what any other caller gets, unchanged

        def placeholder(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            if sys._getframe(1).f_code is not TRL_SCORING_CODE:  # a reward function, rollout_func, ...: real values
                return real(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            nan = torch.full((), math.nan, device=input_ids.device)
            return nan.expand(input_ids.size(0), logits_to_keep), None, None

        self._get_per_token_logps_and_entropies = placeholder
        try:
            yield
        finally:  # back to the class method, or to whatever instance attribute was there before
            vars(self).pop("_get_per_token_logps_and_entropies", None)
            if saved is not None:
                self._get_per_token_logps_and_entropies = saved

    @property
    def _deferred_passes(self) -> tuple[bool, bool]:
        """(old policy, reference): whether TRL's `_generate_and_score_completions` runs each pass, by TRL's own
        conditions: the old-policy pass when gradient_accumulation_steps is not a multiple of
        steps_per_generation × num_iterations, or under the vLLM importance-sampling correction; the reference pass
        when beta != 0. Otherwise TRL's loss uses the policy pass's own detached log-probs (ratio exactly 1)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
        return self.args.gradient_accumulation_steps % generate_every != 0 or vllm_is, self.beta != 0.0

    def _compute_deferred_logps(self, chunk):
        """The old-policy / reference log-probs of one kept micro-batch, computed on the very tensors `_compute_loss`
        feeds the policy pass (same rows, padding, width and batch), so that at the first micro-step the ratio is
        exactly 1 in any precision; with vLLM's correction, its importance-sampling ratio from them.

        The reference branch mirrors TRL's (`GRPOTrainer._generate_and_score_completions`, which has no helper for it):
        the reference model when there is one, else the PEFT model with adapters disabled, or with the adapter "ref"
        when TRL loaded an initial copy under that name."""
        has_old, has_ref = self._deferred_passes
        if not (has_old or has_ref):
            return
        ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], dim=1)
        mask = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], dim=1)
        width = chunk["completion_ids"].size(1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if has_old:
                chunk["old_per_token_logps"] = self._get_per_token_logps_and_entropies(self.model, ids, mask, width)[0]
            if has_ref:
                if self.ref_model is not None:
                    ref_model, context = self.ref_model, nullcontext()
                else:
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    ref_model = self.model
                    context = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
                with context:
                    chunk["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                        ref_model, ids, mask, width
                    )[0]
        if self.use_vllm and self.vllm_importance_sampling_correction:
            chunk["importance_sampling_ratio"] = vllm_importance_sampling_ratio(
                chunk["old_per_token_logps"],
                chunk["sampling_per_token_logps"],
                self._loss_mask(chunk),
                mode=self.vllm_importance_sampling_mode,
                clip_min=self.vllm_importance_sampling_clip_min,
                clip_max=self.vllm_importance_sampling_clip_max,
            )

    def _vllm_ratio_stats(self, chunk) -> torch.Tensor:
        """On the chunk's device, no transfer, float32: [Σ|Δ|, count, max |Δ|, min r, Σ r, count r, max r] over the
        loss tokens (Δ = old − sampling log-prob, NaN excluded; r per token, or per row for the sequence modes), as
        TRL logs them over the full batch."""
        mask = self._loss_mask(chunk).bool()
        delta = (chunk["old_per_token_logps"] - chunk["sampling_per_token_logps"]).abs().float()
        valid = mask & ~torch.isnan(delta)
        ratio = chunk["importance_sampling_ratio"].float()
        on = valid.new_ones(ratio.shape) if self.vllm_importance_sampling_mode.startswith("sequence") else mask
        zero = delta.new_zeros(())
        inf = delta.new_full((), math.inf)
        return torch.stack(
            [
                torch.where(valid, delta, zero).sum(),
                valid.sum().float(),
                torch.where(valid, delta, -inf).amax(),
                torch.where(on, ratio, inf).amin(),
                torch.where(on, ratio, zero).sum(),
                on.sum().float(),
                torch.where(on, ratio, -inf).amax(),
            ]
        )

    def _log_vllm_ratio(self, chunks, local, device):
        """TRL's five vLLM metrics over the kept rows, reduced over ranks as TRL reduces them (`vllm_metrics`: means
        of per-rank means, extremes of per-rank extremes; their latest values, appended by TRL from the placeholder,
        are replaced), with the buffer's counters: one gather (several processes) and one host copy.

        Nothing float64 reaches the device (not every device has it): the statistics are float32 there (TRL's own
        precision for these metrics) and travel as their bit pattern, the float64 host counters as theirs
        (`plan.float64_bits`), both in one int64 tensor; the counters are summed over ranks on the host, exactly.

        `chunks` are this rank's real micro-batches, possibly none (every position a no-op): the rank then sends the
        statistics of no token (`vllm_ratio.combine_ratio_stats`) and joins the gather all the same, so the ranks stay
        in lock-step and every rank logs the same values."""
        # (micro-batches, 7), float32; none on a rank without a real micro-batch, which sends a no-token row
        stats = [self._vllm_ratio_stats(c) for c in chunks]
        reduced = combine_ratio_stats(torch.stack(stats) if stats else torch.empty((0, 7), device=device))
        counters = float64_bits(torch.tensor(list(local.values()), dtype=torch.float64))
        wire = torch.cat([reduced.view(torch.int32).to(torch.int64), counters.to(reduced.device)]).unsqueeze(0)
        if self.accelerator.num_processes > 1:
            wire = self.accelerator.gather(wire.to(device))
        wire = wire.cpu()
        r = wire[:, :7].to(torch.int32).view(torch.float32).double()
        metrics = self._metrics["train"]
        for key, value in zip(VLLM_METRICS, vllm_metrics(r), strict=True):
            if metrics[key]:
                metrics[key][-1] = value
            else:
                metrics[key].append(value)
        for key, value in zip(local, to_float64(wire[:, 7:]).sum(0).tolist(), strict=True):
            self._cost_aware_totals[key] += value
