"""The packed micro-batch layout's trainer methods (a mixin of `CostAwareGRPOTrainer`, docs/layout.md).

`layout.packed_micro_steps` says which kept rows each micro-step position trains on; these methods build the
micro-batches (trimmed, with the loss type's correction), the no-op micro-steps, and the loss of both: a no-op adds no
gradient and no metric, and skips the model where that is safe. The trainer's `_process_new_buffer` calls
`_pack_buffer` when the layout is "packed". The methods read TRL's attributes (`args`, `beta`, `accelerator`,
`_metrics`, `loss_type`, ...) and the trainer's `_loss_mask`, `_compute_deferred_logps` and `_grouping_generator`.
"""

from __future__ import annotations

import torch

from .batching import noop_micro_batch, row_lengths, select_rows, trim_to_longest
from .layout import (
    layout_for,
    micro_token_factor,
    optimizer_segments,
    packed_micro_steps,
    row_mean_scale,
    token_mean_scale,
)
from .plan import check_loss_type

# Keys of the packed layout's micro-batches (host values; TRL's loss reads neither): a no-op micro-step, and the
# multiplier of β for that micro-batch (`layout.row_mean_scale`, `layout.token_mean_scale`).
NOOP_KEY = "cost_aware_noop"
BETA_SCALE_KEY = "cost_aware_beta_scale"
# This rank's (loss tokens, rows) of a real packed micro-batch: the weights of its metrics (`_token_weighted_metrics`).
METRIC_WEIGHTS_KEY = "cost_aware_metric_weights"
# TRL's per-micro-batch metrics that are a mean over the micro-batch's loss tokens on all ranks (`global_masked_mean`
# in `GRPOTrainer._compute_loss`), or over its rows for a per-sequence value: "entropy" and "kl" always per token,
# "vespo/phi_seq_mean" always per row, the clip ratios per token or, with importance_sampling_level="sequence", per
# row. The extremes "clip_ratio/low_min" and "clip_ratio/high_max" (a micro-batch's min/max over its rows) are not
# means and stay TRL's mean over micro-batches.
PER_TOKEN_METRICS = ("entropy", "kl")
PER_ROW_METRICS = ("vespo/phi_seq_mean",)
PER_LEVEL_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
# Backends on which a no-op micro-step may skip the model when it does not sync gradients: plain data parallel (DDP
# accumulates locally under no_sync; nothing counts micro-steps). DeepSpeed counts micro-steps and accumulation
# boundaries in its engine, FSDP/XLA/Megatron shard or trace: there the no-op runs a 1-token forward/backward.
DATA_PARALLEL_TYPES = frozenset(
    ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU", "MULTI_SDAA")
)


class PackedLayout:
    """The packed layout's methods; mixed into `CostAwareGRPOTrainer` before `GRPOTrainer`."""

    def _check_layout(self):
        """At construction: the layout this trainer runs, in `self._layout` (`layout.layout_for`: "packed", or "even"
        with an entropy bonus or a router aux loss, known once the model is loaded)."""
        self._layout = layout_for(self.args, bool(self.aux_loss_enabled)) if self.args.cost_aware else "even"

    def _pack_buffer(self, kept_batch, chunks, host, plan):
        """The packed layout of one generation batch (`layout.packed_micro_steps`): the S micro-step entries, each a
        trimmed micro-batch of kept rows with the loss type's correction, or a no-op (`batching.noop_micro_batch`),
        and, for each real micro-batch in order, the host keys to add to it once the deferred passes have run: its β
        multiplier (`BETA_SCALE_KEY`) and its metric weights (`METRIC_WEIGHTS_KEY`).

        Rows are assigned to optimizer steps in TRL's shuffled order (the chunks' kept positions, then the m mod S rows
        TRL's split left out, the whole order then shuffled with the grouping stream). Corrections, per micro-batch
        of r rows in a run of q rows, g micro-steps and T_run loss tokens (docs/layout.md): a mean over rows (grpo,
        sapo, dr_grpo, luspo) times r·g/q on the advantages and on β; bnpo the even layout's factor T/T̄_full on the
        advantages and T·g/T_run on β; a batch-token loss (dapo, cispo, vespo) nothing."""
        m = len(kept_batch["cost_aware_rows"])
        seen = [i for c in chunks for i in c["cost_aware_rows"]]
        missing = sorted(set(range(m)) - set(seen))
        order = seen + missing
        if missing:
            order = [order[i] for i in torch.randperm(m, generator=self._grouping_generator).tolist()]
        if host is not None:
            lengths = (host["prompt_tokens"] + host["completion_tokens"]).tolist()
            loss_tokens = host["loss_tokens"].tolist()
        else:  # a subclass's own draw: one transfer each
            lengths = row_lengths(kept_batch).cpu().tolist()
            loss_tokens = self._loss_mask(kept_batch).sum(-1).cpu().tolist()
        spg, accumulation = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        # Where a no-op is free (skipped), the fewest, fullest micro-batches; where it runs a forward anyway
        # (DeepSpeed), the rows spread over every position of the run: the even layout's forwards, sorted.
        steps = packed_micro_steps(
            order, lengths, spg, accumulation, self.args.per_device_train_batch_size, fill=self._pack_fill
        )
        count, g = optimizer_segments(spg, accumulation)
        q = m // count
        run_tokens = [sum(loss_tokens[i] for i in order[s * q : (s + 1) * q]) for s in range(count)]
        normaliser = check_loss_type(self.loss_type)
        noop = self._noop_micro_batch(kept_batch)
        out, extras = [], []
        for position, rows in enumerate(steps):
            if rows is None:
                out.append(noop)
                continue
            index = torch.tensor(rows)
            width = None
            if host is not None:
                width = (float(host["prompt_tokens"][index].max()), float(host["completion_tokens"][index].max()))
            chunk = trim_to_longest(select_rows(kept_batch, index), self.pad_to_multiple_of, width)
            chunk.pop("cost_aware_rows", None)
            tokens = float(sum(loss_tokens[i] for i in rows))
            beta_scale = 1.0
            if normaliser.rows:
                beta_scale = row_mean_scale(len(rows), q, g)
                chunk["advantages"] = chunk["advantages"] * beta_scale
            elif normaliser.micro_tokens:
                beta_scale = token_mean_scale(tokens, run_tokens[position // g], g)
                if plan is not None and plan.micro_tokens_full is not None:
                    chunk["advantages"] = chunk["advantages"] * micro_token_factor(tokens, plan.micro_tokens_full)
            self._compute_deferred_logps(chunk)
            out.append(chunk)
            extras.append({BETA_SCALE_KEY: beta_scale, METRIC_WEIGHTS_KEY: (tokens, float(len(rows)))})
        return out, extras

    def _noop_micro_batch(self, kept_batch):
        """A no-op micro-step's batch (`batching.noop_micro_batch`: 1 row, 1 prompt token, 1 completion token the loss
        does not see, advantage 0), with what TRL's loss reads besides: a reference log-prob when β ≠ 0 (−1e4: the
        KL term exp(ref − logp) − (ref − logp) − 1 stays finite whatever the policy's log-prob, and the mask zeroes
        it) and a unit importance-sampling ratio under vLLM's correction."""
        noop = noop_micro_batch(kept_batch)
        device = noop["completion_ids"].device
        if self.beta != 0.0:
            noop["ref_per_token_logps"] = torch.full((1, 1), -1e4, device=device)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            noop["importance_sampling_ratio"] = torch.ones((1, 1), device=device)
        noop[NOOP_KEY] = True
        return noop

    @property
    def _noop_skippable_backend(self) -> bool:
        """Whether a no-op micro-step that does not sync gradients may skip the model (`DATA_PARALLEL_TYPES`, and not
        accelerate's `sync_each_batch`)."""
        accelerator = self.accelerator
        if accelerator.distributed_type.name not in DATA_PARALLEL_TYPES:
            return False
        return accelerator.num_processes == 1 or not accelerator.gradient_state.plugin_kwargs.get(
            "sync_each_batch", False
        )

    @property
    def _pack_fill(self) -> bool:
        """Whether runs are packed into the fewest, fullest micro-batches (no-ops are free: `_noop_skippable_backend`)
        or spread over all their micro-step positions, sorted (a no-op would run a forward anyway)."""
        return self._noop_skippable_backend

    def _compute_loss(self, model, inputs):
        """The packed layout's micro-steps (`_pack_buffer`). A no-op: on one process, and under DDP on a micro-step
        that does not sync, a zero loss without the model (DDP accumulates locally there; the packed layout puts the
        real micro-batches last in each optimizer step, so the syncing micro-step runs the model); elsewhere TRL's loss
        on the 1-token no-op batch (zero gradient), with the metrics TRL appends for it removed, so entropy, clip
        ratios and KL are means over real micro-batches only. A real micro-batch: TRL's loss with β times its
        `BETA_SCALE_KEY` (composed with the trainer's own β rescale, which calls this through `super()`); its metric
        weights are kept for `_token_weighted_metrics`."""
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        if inputs.get(NOOP_KEY):
            if self._noop_skippable_backend and (
                self.accelerator.num_processes == 1 or not self.accelerator.sync_gradients
            ):
                return torch.zeros((), device=inputs["completion_ids"].device, requires_grad=True)
            metrics = self._metrics["train"]
            before = {key: len(values) for key, values in metrics.items()}
            loss = super()._compute_loss(model, inputs)
            for key in list(metrics):
                if key not in before:
                    del metrics[key]
                else:
                    del metrics[key][before[key] :]
            return loss
        scale = inputs.get(BETA_SCALE_KEY)
        if scale is None or scale == 1.0 or self.beta == 0.0:
            loss = super()._compute_loss(model, inputs)
        else:
            beta = self.beta
            self.beta = beta * scale  # > 0: TRL's `beta != 0` branches (and their collectives) run on every rank alike
            try:
                loss = super()._compute_loss(model, inputs)
            finally:
                self.beta = beta
        weights = inputs.get(METRIC_WEIGHTS_KEY)
        if weights is not None:
            self._packed_metric_weights.append(weights)
        return loss

    def _token_weighted_metrics(self):
        """At a train `log`, under the packed layout: TRL's per-micro-batch means (`PER_TOKEN_METRICS`,
        `PER_ROW_METRICS`, `PER_LEVEL_METRICS`) of the window replaced by their mean over the window's loss tokens
        (rows for a per-sequence value), summed over ranks:

            value = Σ_k C_k v_k / Σ_k C_k     (v_k: micro-batch k's value, C_k its global token or row count),

        the mean over the step's tokens that TRL's unweighted mean over micro-batches is when they hold equal tokens
        (as GRPOTrainer's B-row micro-batches do in expectation); packed micro-batches are fewer and unequal. One
        gather of the window's counts (several processes; every rank logs the same window). A metric whose entries do
        not pair one to one with the window's micro-batches is left as TRL averages it."""
        weights, self._packed_metric_weights = self._packed_metric_weights, []
        if not weights:
            return
        local = {f"{kind}{k}": w[i] for k, w in enumerate(weights) for i, kind in enumerate(("t", "r"))}
        summed = self._sum_over_ranks(local, self.accelerator.device)
        tokens = [summed[f"t{k}"] for k in range(len(weights))]
        rows = [summed[f"r{k}"] for k in range(len(weights))]
        per_row_level = self.args.importance_sampling_level == "sequence"
        metrics = self._metrics["train"]
        for key in PER_TOKEN_METRICS + PER_ROW_METRICS + PER_LEVEL_METRICS:
            values = metrics.get(key)
            if not values or len(values) != len(weights):
                continue
            by_row = key in PER_ROW_METRICS or (key in PER_LEVEL_METRICS and per_row_level)
            counts = rows if by_row else tokens
            total = sum(counts)
            if total > 0:
                metrics[key] = [sum(c * float(v) for c, v in zip(counts, values, strict=True)) / total]
