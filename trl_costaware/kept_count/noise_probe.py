"""The noise probe: the gradient noise of a generation batch measured within one point of the parameters, split into
its between-prompt and within-group parts (a mixin of `CostAwareGRPOTrainer`; the math is `noise_parts.py`).

**Why.** The noise scale of `step_signals.py` pairs the gradients of two optimizer steps. The parameters move between
them, which lowers the signal estimate: the ρ a run read that way was 1.1–2.7× the one read with the learning rate at
0 (BENCHMARKS.md §10.1). And it cannot tell which part of the noise a row sample adds to: only the within-group part
(which rollouts of a prompt were drawn or kept), not the between-prompt part (which prompts were drawn), so the kept
count's rule priced a row sample as if every row were independent (§8.2: 0.05–0.57 of that was real).

**What it does.** On a probed training generation batch (the first `PROBE_WARMUP`, then every
`cost_aware_noise_probe_every`-th), after TRL has scored it and before the row stage, this rank's rows are split at
random into four quarters (`noise_parts.quarter_labels`: half of the prompts × half of each prompt's rollouts), and
the gradient of the policy-gradient term

    ℓ_q = − Σ_{i in quarter q} A_i Σ_t m_it log π(y_it) / Z_i       (Z_i: the row's loss tokens for the loss types
                                                                      that average over a row's tokens, else 1)

is taken for each quarter at the current parameters (the on-policy gradient of every TRL loss type's policy term at
its first iteration, up to the loss type's constant normaliser, which cancels in every ratio used; rows with A_i = 0
add nothing and are not run). From the accumulated H_A, H_B and R (three gradient-sized float32 buffers of the
trainable parameters) `noise_parts.parts_from_sums` gives the batch's total noise, its within-group part and the
signal. All ranks' terms are averaged (one all-reduce of three numbers): a world of W ranks has W times the rows, so
the global batch's noise is the mean of the ranks' over W. A batch generated for a fraction φ of its prompts has 1/φ
times the full batch's noise, so its noise terms enter ×φ: the probe always reports the full generation batch.

The terms are smoothed over probes by bias-corrected moving averages (`PROBE_EMA`), and

    ρ = total / signal        (∞ when the signal is not positive),      w = within / total  (clamped to [0, 1]).

**Cost.** One forward and backward over the batch's informative rows per probed batch, in micro-batches of
`per_device_train_batch_size` rows (the same peak memory as a training micro-step) plus the three buffers; it is
timed into the step's fixed cost, so the rules pay for it. `cost_aware_noise_probe_every=0` turns it off (the rules
then read the noise scale of `step_signals.py`, as before).

**Where it runs.** One process and DDP (the backward runs on the unwrapped module after the previous optimizer step,
when DDP's reducer expects no gradient, and the trainer's own `.grad` is stashed and restored around it). Not under
DeepSpeed or FSDP (sharded parameters and gradients), nor when a rank's generation batch holds fewer than two whole
groups, nor for multimodal batches: there the probe is off and says so once.
"""

from __future__ import annotations

import math
import warnings

import torch

from ..core.sampling import stream_generator
from .compute_budget import Ema
from .noise_parts import parts_from_sums, quarter_labels

# Probed training generation batches: the first PROBE_WARMUP, then every `cost_aware_noise_probe_every`-th.
PROBE_WARMUP = 3
# Probes the rules need before they act on the probe's ρ and w.
MIN_PROBES = 2
# Decay of the moving averages over probes (probes are sparse: a shorter memory than the per-step NOISE_EMA).
PROBE_EMA = 0.7
PROBE_STREAM = "noise_probe"
# Batch keys of a multimodal model (the probe's forward passes text only).
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")


def probe_due(index: int, every: int, warmup: int = PROBE_WARMUP) -> bool:
    """Whether training generation batch `index` (1-based) is probed: the first `warmup`, then every `every`-th
    (every = 0: never)."""
    if every <= 0 or index < 1:
        return False
    return index <= warmup or (index - warmup) % every == 0


class NoiseProbe:
    """Mixin for `CostAwareGRPOTrainer` (with `ComputeSignals`, before `GRPOTrainer` in the bases)."""

    def _init_noise_probe(self, row_length: bool):
        args = self.args
        self._probe_every = int(args.cost_aware_noise_probe_every)
        self._probe_row_length = bool(row_length)
        decay = PROBE_EMA
        self._probe_total, self._probe_within, self._probe_signal = Ema(decay), Ema(decay), Ema(decay)
        self._probe_count = 0
        self._probe_generator = stream_generator(args.seed, self.accelerator.process_index, PROBE_STREAM)
        self._probe_on = False
        if not (self._signals_on and self._probe_every > 0):
            return
        rows, g = args.per_device_train_batch_size * args.steps_per_generation, self.num_generations
        why = None
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            why = "DeepSpeed and FSDP shard the parameters and gradients it reads"
        elif rows % g or rows // g < 2:
            why = (
                f"a rank's generation batch must hold at least two whole groups: per_device_train_batch_size x "
                f"steps_per_generation = {rows} rows, num_generations={g}"
            )
        if why is not None:
            warnings.warn(
                f"cost_aware_noise_probe_every={self._probe_every}: the noise probe is off ({why}); the rules read "
                "the noise scale of consecutive optimizer steps instead.",
                UserWarning,
                stacklevel=3,
            )
            return
        self._probe_on = True

    # ------------------------------------------------------------------ what the rules read
    def _probe_ready(self) -> bool:
        return self._probe_count >= MIN_PROBES and self._probe_signal.value is not None

    def _probe_rho(self) -> float | None:
        """ρ of the full generation batch from the probes (None before `MIN_PROBES`; ∞ when the signal is not
        positive)."""
        if not self._probe_ready():
            return None
        signal = self._probe_signal.value
        if not signal > 0:
            return math.inf
        return max(self._probe_total.value, 0.0) / signal

    def _probe_within_share(self) -> float | None:
        """w = within / total, in [0, 1] (None before `MIN_PROBES` or without noise)."""
        if not self._probe_ready():
            return None
        total = self._probe_total.value
        if not total > 0:
            return None
        return min(max(self._probe_within.value / total, 0.0), 1.0)

    # ------------------------------------------------------------------ the probe
    def _maybe_probe(self, batch, fraction: float):
        """Probes this training generation batch if it is due (module docstring), its seconds counted in the step's
        fixed cost (`_note_probe`)."""
        if not (self._probe_on and probe_due(self._generation_index, self._probe_every)):
            return
        if any(key in batch for key in MULTIMODAL_KEYS):
            self._probe_on = False
            warnings.warn(
                "cost_aware_noise_probe_every: the noise probe runs text-only models; it is off for this multimodal "
                "batch and the rest of the run.",
                UserWarning,
                stacklevel=2,
            )
            return
        start = self._clock()
        device = self.accelerator.device
        # its own random state: a dropout mask drawn here must not shift the rollouts' sampling that follows, so a run
        # with the probe trains exactly as one without it
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            terms = self._probe_terms(batch)
        if terms is not None:
            self._record_probe(*terms, fraction)
        self._note_probe(self._clock() - start)

    def _probe_terms(self, batch) -> tuple[float, float, float] | None:
        """(total, within, signal) of this rank's batch (module docstring), None when it holds fewer than two groups
        (a prompt fraction's batch of one group: the probe is skipped)."""
        g = self.num_generations
        n = len(batch["advantages"])
        if n % g or n // g < 2:
            return None
        labels, a, b = quarter_labels(n // g, g, self._probe_generator)
        mask = self._loss_mask(batch)
        host = torch.stack(
            [
                batch["advantages"].detach().float(),
                batch["prompt_mask"].sum(-1).float(),
                batch["completion_mask"].sum(-1).float(),  # the width (a tool mask can hide tokens before loss tokens)
            ]
        ).cpu()
        informative = host[0] != 0
        model = self.accelerator.unwrap_model(self.model)
        params = [p for p in model.parameters() if p.requires_grad]
        stashed = [p.grad for p in params]
        for p in params:
            p.grad = None
        buffers = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(3)]  # H_A, H_B, R
        try:
            for quarter in range(4):
                rows = torch.nonzero((labels == quarter) & informative).flatten().tolist()
                if not rows:
                    continue
                self._probe_backward(model, batch, mask, rows, host)
                half = buffers[0] if quarter < 2 else buffers[1]
                sign = 1.0 / b if quarter in (0, 2) else -1.0 / (1.0 - b)
                grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).float() for p in params]
                torch._foreach_add_(half, grads)
                torch._foreach_add_(buffers[2], grads, alpha=sign)
                for p in params:
                    p.grad = None
        finally:
            for p, grad in zip(params, stashed, strict=True):
                p.grad = grad
        h_a, h_b, r = buffers
        terms = torch.stack(
            [
                torch.stack([x.square().sum() for x in h_a]).sum(),
                torch.stack([x.square().sum() for x in h_b]).sum(),
                torch.stack([(x * y).sum() for x, y in zip(h_a, h_b, strict=True)]).sum(),
                torch.stack([x.square().sum() for x in r]).sum(),
            ]
        )
        parts = parts_from_sums(*terms.cpu().double().tolist(), a, b, n)  # one transfer; no float64 on the device
        return parts.total, parts.within, parts.signal

    def _probe_backward(self, model, batch, mask, rows: list[int], host: torch.Tensor):
        """Accumulates into `.grad` the gradient of the policy-gradient term of `rows` (module docstring), in
        micro-batches of `per_device_train_batch_size` rows, each trimmed to its longest prompt and completion."""
        size = max(1, int(self.args.per_device_train_batch_size))
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            index = torch.tensor(chunk, device=batch["advantages"].device)
            prompt_width = max(1, int(host[1][chunk].max()))
            completion_width = max(1, int(host[2][chunk].max()))
            # TRL left-pads prompts and right-pads completions
            prompt_ids = batch["prompt_ids"][index][:, -prompt_width:]
            prompt_mask = batch["prompt_mask"][index][:, -prompt_width:]
            completion_ids = batch["completion_ids"][index][:, :completion_width]
            completion_mask = mask[index][:, :completion_width]
            attention = torch.cat([prompt_mask, batch["completion_mask"][index][:, :completion_width]], dim=1)
            logps, _, _ = self._get_per_token_logps_and_entropies(
                model, torch.cat([prompt_ids, completion_ids], dim=1), attention, completion_width
            )
            weights = completion_mask.to(logps.dtype)
            per_row = (logps * weights).sum(-1)
            if self._probe_row_length:
                per_row = per_row / weights.sum(-1).clamp(min=1.0)
            advantages = batch["advantages"][index].detach().to(per_row.dtype)
            (-(advantages * per_row).sum()).backward()

    def _record_probe(self, total: float, within: float, signal: float, fraction: float):
        """Averages the ranks' terms into the global full batch's (module docstring), updates the moving averages
        and logs them."""
        values = torch.tensor([total, within, signal], dtype=torch.float64)
        world = self.accelerator.num_processes
        if world > 1:
            device = self.accelerator.device
            dtype = torch.float64 if device.type != "mps" else torch.float32
            values = values.to(device=device, dtype=dtype)
            torch.distributed.all_reduce(values)
            values = values.double().cpu() / world
        total, within, signal = values.tolist()
        total, within = total * fraction / world, within * fraction / world
        if not all(math.isfinite(v) for v in (total, within, signal)):
            return
        self._probe_total.update(total)
        self._probe_within.update(within)
        self._probe_signal.update(signal)
        self._probe_count += 1
        metrics = self._metrics["train"]
        metrics["cost_aware/noise_probe_total"].append(total)
        metrics["cost_aware/noise_probe_within"].append(within)
        metrics["cost_aware/noise_probe_signal"].append(signal)
        rho, share = self._probe_rho(), self._probe_within_share()
        if rho is not None and math.isfinite(rho):
            metrics["cost_aware/noise_probe_noise_to_signal"].append(rho)
        if share is not None:
            metrics["cost_aware/noise_probe_within_share"].append(share)

    def _probe_state(self) -> dict:
        return {
            "emas": [[e.total, e.weight] for e in (self._probe_total, self._probe_within, self._probe_signal)],
            "count": self._probe_count,
            "generator": self._probe_generator.get_state(),
        }

    def _load_probe_state(self, state: dict, own_rank: bool):
        for ema, (total, weight) in zip(
            (self._probe_total, self._probe_within, self._probe_signal), state["emas"], strict=True
        ):
            ema.total, ema.weight = float(total), float(weight)
        self._probe_count = int(state["count"])
        if own_rank:
            self._probe_generator.set_state(state["generator"])
