"""`CostAwareGRPOTrainer`: GRPO that trains on a cost-aware sample of each generation batch.

Mohri, Globerson, Kaplan, Koren, Mansour, "Cost-Aware Learning", arXiv 2604.28020 (2026). See ALGORITHM.md §2.

The trainer overrides little and copies nothing from TRL: it calls `GRPOTrainer`'s methods and post-processes what
they return. The math lives in `sampling.py` (distribution, draw, weights, diagnostics) and `batching.py` (row
selection, padding trimming).
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext

import torch
from transformers import ProcessorMixin
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from .batching import regroup_by_length, row_lengths, select_rows, trim_to_longest
from .config import CostAwareGRPOConfig, resolve_cost_fn
from .sampling import (
    draw_rows,
    gradient_proxy,
    j_ratio_achieved,
    j_ratio_ideal,
    kept_row_count,
    kept_rows_for_token_budget,
    normalize_weights,
    sampling_distribution,
    sampling_scores,
    sequence_costs,
)
from .tracking import attach_tracking, validate_report_to

# Loss types whose policy term is a token sum over a normaliser fixed by the FULL generation batch
# (`num_items_in_batch`, kept as TRL computed it before sampling). A kept row must then stand for 1/π_i rows, so its
# factor is w_i · N/m. The row-mean types (grpo, sapo, dr_grpo, luspo) take a mean over the rows of the micro-batch,
# whose count shrinks with sampling, so their factor is w_i = m/(N π_i).
TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")
# bnpo divides each micro-batch by its own token count, which sampling would bias toward short rows: we replace it
# with the full batch's mean micro-batch token count (factor w_i · N/m · T_micro_kept / (T_full / steps_per_gen)).
MICRO_TOKEN_MEAN_LOSSES = ("bnpo",)

STATE_FILE = "cost_aware_state_rank{rank}.pt"


class CostAwareGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for [`trl.GRPOTrainer`] implementing Cost-Aware GRPO.

    After TRL generates and scores a generation batch (N rows on this rank), the trainer draws m rows with
    probability ∝ |A_i|/√c_i (smoothed with the uniform distribution), multiplies each kept row's advantage by its
    importance weight (a positive per-row factor scales every TRL loss type's policy term exactly), and hands the kept
    rows back to TRL, which splits them into micro-batches as usual. Dropped rows cost nothing after generation:
    reference and old-policy log-probabilities are computed for kept rows only, and each micro-batch is trimmed to its
    longest row.

    Args:
        model, reward_funcs, **kwargs: as for `GRPOTrainer`.
        args ([`CostAwareGRPOConfig`]): the configuration; a plain `GRPOConfig` is rejected.
    """

    _tag_names = ["trl", "grpo", "cost-aware"]
    _name = "CostAwareGRPO"

    def __init__(self, model, reward_funcs, args: CostAwareGRPOConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = CostAwareGRPOConfig(f"{model_name.split('/')[-1]}-CostAwareGRPO")
        if not isinstance(args, CostAwareGRPOConfig):
            raise TypeError(
                f"args must be a CostAwareGRPOConfig, got {type(args).__name__}. Replace GRPOConfig(...) with "
                "CostAwareGRPOConfig(...): it accepts every GRPOConfig field."
            )
        validate_report_to(args)  # fail before the model loads
        super().__init__(model, reward_funcs, args=args, **kwargs)
        attach_tracking(self)  # local metrics record; W&B group and token x-axis (before TRL's WandbCallback)
        if args.cost_aware and isinstance(self.processing_class, ProcessorMixin):
            raise NotImplementedError(
                "cost_aware=True supports text-only models; this model has a multimodal processor whose image "
                "tensors are not per-row. Set cost_aware=False to train it with plain GRPO."
            )
        self._cost_fn = resolve_cost_fn(args.cost_aware_cost)
        seed = args.seed if args.cost_aware_seed is None else args.cost_aware_seed
        self._sampler_generator = torch.Generator().manual_seed(seed * 1_000_003 + self.accelerator.process_index)
        # Global (all ranks) cumulative counters, identical on every rank; saved in checkpoints.
        self._cost_aware_totals = {
            "rollout_tokens": 0.0,  # prompt + completion tokens of every generated rollout
            "generated_tokens": 0.0,  # completion tokens of every generated rollout
            "policy_tokens": 0.0,  # real tokens in policy-optimisation micro-batches, each pass counted
            "policy_tokens_padded": 0.0,  # rows × width of those micro-batches
            "rows_generated": 0.0,
            "rows_kept": 0.0,
        }
        self._processed_buffer = None

    # ------------------------------------------------------------------ generation batch: sample the rows
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)  # evaluation is untouched
        if not self.args.cost_aware:
            batch = super()._generate_and_score_completions(inputs)
            self._record_generation(batch)
            return batch
        with self._deferred_scoring_logps() as deferred:
            batch = super()._generate_and_score_completions(inputs)
        kept, factors = self._draw_kept_rows(batch)
        advantages = batch["advantages"]
        # The sampler works on the host: its indices and factors move to the batch's device (and dtype) here.
        batch = select_rows(batch, kept.to(advantages.device))
        batch["advantages"] = batch["advantages"] * factors.to(device=advantages.device, dtype=advantages.dtype)
        batch = trim_to_longest(batch)
        self._compute_deferred_logps(batch, deferred)
        return batch

    @contextmanager
    def _deferred_scoring_logps(self):
        """While TRL scores a generation batch, skip its no-grad log-prob passes (old policy, reference) and record
        them, so they run afterwards on the kept rows only. With vLLM importance-sampling correction TRL needs the
        old log-probs of every row at once for its ratio, so that pass runs as usual."""
        calls = []
        original = self._get_per_token_logps_and_entropies
        run_first = self.use_vllm and self.vllm_importance_sampling_correction

        def record(model, *args, **kwargs):
            if run_first and not calls:
                calls.append("computed")
                return original(model, *args, **kwargs)
            calls.append("deferred")
            return None, None, None

        self._get_per_token_logps_and_entropies = record
        try:
            yield calls
        finally:
            del self._get_per_token_logps_and_entropies

    def _compute_deferred_logps(self, batch, calls):
        # TRL computes the old-policy pass first (when needed), then the reference pass (when beta != 0).
        deferred = [c for c in calls if c == "deferred"]
        has_ref = self.beta != 0.0
        has_old = len(deferred) - int(has_ref) == 1
        if not deferred:
            return
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        width = batch["completion_ids"].size(1)
        bs = self.args.per_device_train_batch_size
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if has_old:
                batch["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                    self.model, ids, mask, width, batch_size=bs
                )[0]
            if has_ref:
                if self.ref_model is not None:
                    ref_model, context = self.ref_model, nullcontext()
                else:  # PEFT: the base model (adapters disabled) or an initial copy loaded as adapter "ref"
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    ref_model = self.model
                    context = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
                with context:
                    batch["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                        ref_model, ids, mask, width, batch_size=bs
                    )[0]

    def _row_costs(self, batch) -> torch.Tensor:
        if self._cost_fn is not None:
            costs = torch.as_tensor(self._cost_fn(batch["prompt_mask"], batch["completion_mask"])).float()
            if costs.shape != (len(batch["completion_mask"]),):
                raise ValueError(f"cost_aware_cost callable must return one cost per row, got shape {costs.shape}")
            return costs.to(batch["completion_mask"].device)
        return sequence_costs(batch["prompt_mask"], batch["completion_mask"], self.args.cost_aware_cost)

    def _host_row_stats(self, batch) -> dict[str, torch.Tensor]:
        """Per-row scalars the sampler needs, copied to the host in ONE device→host transfer per generation batch
        (the only synchronisation of the sampler's host work; the cross-rank gathers below are collectives)."""
        loss_mask = self._loss_mask(batch)
        columns = {
            "advantages": batch["advantages"].detach().float(),
            "costs": self._row_costs(batch).float(),
            "lengths": row_lengths(batch).float(),
            "loss_tokens": loss_mask.sum(-1).float(),
            "completion_tokens": batch["completion_mask"].sum(-1).float(),
        }
        host = torch.stack(list(columns.values()), dim=1).cpu()
        return dict(zip(columns, host.unbind(1), strict=True))

    def _draw_kept_rows(self, batch):
        """Draw the kept rows of this rank's generation batch; return their indices and advantage factors, both on
        the host (the caller moves them to the batch's device)."""
        args = self.args
        device = batch["advantages"].device
        rows = self._host_row_stats(batch)
        advantages, costs = rows["advantages"], rows["costs"]
        n = len(advantages)
        spg = args.steps_per_generation
        p = sampling_distribution(sampling_scores(advantages, costs, args.cost_aware_proxy), args.cost_aware_smoothing)
        if args.cost_aware_token_budget is not None:
            m_local = kept_rows_for_token_budget(p, costs, args.cost_aware_token_budget, n)
            m = int(self.accelerator.gather(torch.tensor([m_local], device=device)).min())  # ranks stay in lock-step
            m = kept_row_count(n, m / n, spg)
        else:
            m = kept_row_count(n, args.cost_aware_kept_fraction, spg)
        draw = draw_rows(p, m, args.cost_aware_draw, self._sampler_generator)

        # Weight normalisation over the kept rows of all ranks (every rank keeps m rows, so the gather is even).
        all_weights = draw.weights.float()
        if self.accelerator.num_processes > 1:
            all_weights = self.accelerator.gather(all_weights.to(device)).cpu()
        weights, stats = normalize_weights(
            all_weights, args.cost_aware_weight_normalization, args.cost_aware_weight_floor, args.cost_aware_weight_cap
        )
        rank = self.accelerator.process_index
        factors = weights[rank * m : (rank + 1) * m]
        if self.loss_type in TOKEN_SUM_LOSSES + MICRO_TOKEN_MEAN_LOSSES:
            factors = factors * (n / m)

        g = gradient_proxy(advantages)
        full_tokens = rows["loss_tokens"].sum()
        kept_tokens = rows["loss_tokens"][draw.indices].sum()
        in_sample = torch.zeros(n, dtype=torch.bool)
        in_sample[draw.indices] = True
        if self.loss_type in MICRO_TOKEN_MEAN_LOSSES:
            batch["cost_aware_full_tokens"] = full_tokens.to(device)
        if self.beta != 0.0 and self.loss_type in TOKEN_SUM_LOSSES:
            # The KL term is not importance-weighted (only the advantage carries the weight), so under a full-batch
            # token normaliser it would shrink with the kept tokens; this rescales it back to the full batch's size.
            batch["cost_aware_kl_scale"] = (full_tokens / kept_tokens.clamp(min=1)).to(device)

        lengths = rows["lengths"]
        stats_local = {
            "rows": n,
            "draws": m,
            "kept": float(in_sample.sum()),  # rows in the sample (inclusion mask)
            "dropped": float(n - len(torch.unique(draw.indices))),  # rows never drawn, counted separately
            "informative": float((g > 0).sum()),
            "zero_signal_ranks": float((g > 0).sum() == 0),
            "j_ideal": j_ratio_ideal(g, costs),
            "j_achieved": min(j_ratio_achieved(g, costs, p), 1e6),
            "rollout_tokens": float(lengths.sum()),
            "kept_rollout_tokens": float(lengths[draw.indices].sum()),
            "generated_tokens": float(rows["completion_tokens"].sum()),
        }
        total = self._sum_over_ranks(stats_local, device)
        ranks = self.accelerator.num_processes
        rows, kept = total["rows"], total["kept"]
        metrics = self._metrics["train"]
        metrics["cost_aware/kept_row_fraction"].append(total["draws"] / rows)
        metrics["cost_aware/kept_unique_row_fraction"].append(kept / rows)
        metrics["cost_aware/kept_token_fraction"].append(total["kept_rollout_tokens"] / total["rollout_tokens"])
        metrics["cost_aware/informative_fraction"].append(total["informative"] / rows)
        metrics["cost_aware/zero_signal_ranks"].append(total["zero_signal_ranks"])
        metrics["cost_aware/j_ratio_ideal"].append(total["j_ideal"] / ranks)
        metrics["cost_aware/j_ratio_achieved"].append(total["j_achieved"] / ranks)
        # Per generation batch; the cumulative `cost_aware/rows_generated` and `rows_kept` are added in `log`.
        metrics["cost_aware/batch_rows_generated"].append(rows)
        metrics["cost_aware/batch_rows_kept"].append(kept)
        metrics["cost_aware/batch_rows_dropped"].append(total["dropped"])
        # generated = kept + dropped, the two counted independently (inclusion mask vs. distinct drawn indices).
        metrics["cost_aware/count_check"].append(rows - kept - total["dropped"])
        for key, value in stats.as_dict(prefix="cost_aware/weight_").items():
            metrics[key].append(value)
        self._add_totals(rows, kept, total["rollout_tokens"], total["generated_tokens"])
        return draw.indices, factors

    @staticmethod
    def _loss_mask(batch):
        mask = batch["completion_mask"]
        return mask * batch["tool_mask"] if "tool_mask" in batch else mask

    def _sum_over_ranks(self, values: dict[str, float], device) -> dict[str, float]:
        """One gather of named scalars; returns their sums over ranks (identical on every rank). Single process: the
        values themselves (no device round trip)."""
        if self.accelerator.num_processes == 1:
            return {k: float(v) for k, v in values.items()}
        local = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
        total = self.accelerator.gather(local.unsqueeze(0)).double().sum(0).cpu().tolist()
        return dict(zip(values, total, strict=True))

    def _add_totals(self, rows: float, kept: float, rollout_tokens: float, generated_tokens: float):
        totals = self._cost_aware_totals
        totals["rows_generated"] += rows
        totals["rows_kept"] += kept
        totals["rollout_tokens"] += rollout_tokens
        totals["generated_tokens"] += generated_tokens

    def _record_generation(self, batch):
        """Counters for a generation batch that is trained on in full (cost_aware=False)."""
        total = self._sum_over_ranks(
            {
                "rows": len(batch["completion_mask"]),
                "rollout_tokens": float(row_lengths(batch).sum()),
                "generated_tokens": float(batch["completion_mask"].sum()),
            },
            batch["completion_mask"].device,
        )
        self._add_totals(total["rows"], total["rows"], total["rollout_tokens"], total["generated_tokens"])
        self._metrics["train"]["cost_aware/kept_row_fraction"].append(1.0)
        self._metrics["train"]["cost_aware/kept_token_fraction"].append(1.0)

    # ------------------------------------------------------------------ micro-batches: trim, group, count
    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training or self._buffered_inputs is None:
            return inputs
        if self._buffered_inputs is not self._processed_buffer:
            self._process_new_buffer()
        return self._processed_chunks.get(id(inputs), inputs)

    def _process_new_buffer(self):
        """Runs once per generation batch, when TRL has just split it into micro-batches."""
        chunks = list(self._buffered_inputs)
        if self.args.cost_aware:
            if self.args.cost_aware_group_by_length and len(chunks) > 1:
                chunks = regroup_by_length(chunks, self._sampler_generator)
            chunks = [trim_to_longest(c) for c in chunks]
            if "cost_aware_full_tokens" in chunks[0]:
                # bnpo: replace each micro-batch's own token count by the full batch's mean micro-batch count.
                micro_full = chunks[0]["cost_aware_full_tokens"] / len(chunks)
                for c in chunks:
                    c["advantages"] = c["advantages"] * (self._loss_mask(c).sum() / micro_full).to(c["advantages"])
        # The buffer list is TRL's: map TRL's chunk objects to ours instead of re-deriving TRL's step indexing.
        self._processed_chunks = {id(orig): new for orig, new in zip(self._buffered_inputs, chunks, strict=True)}
        self._processed_buffer = self._buffered_inputs
        passes = self.num_iterations  # each micro-batch is trained on once per iteration
        total = self._sum_over_ranks(
            {
                "policy_tokens": passes * sum(float(row_lengths(c).sum()) for c in chunks),
                "policy_tokens_padded": passes
                * sum(c["prompt_ids"].numel() + c["completion_ids"].numel() for c in chunks),
            },
            chunks[0]["completion_mask"].device,
        )
        for key, value in total.items():
            self._cost_aware_totals[key] += value

    def _compute_loss(self, model, inputs):
        scale = inputs.get("cost_aware_kl_scale")
        if scale is None or self.beta == 0.0:
            return super()._compute_loss(model, inputs)
        beta = self.beta
        self.beta = beta * float(scale)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.beta = beta

    # ------------------------------------------------------------------ logging and checkpoints
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Cumulative counters are the latest value (not a window mean) and go on train and eval rows alike, so
        # eval curves can be drawn against policy tokens too.
        logs.update({f"cost_aware/{k}": v for k, v in self._cost_aware_totals.items()})
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        state = {"generator": self._sampler_generator.get_state(), "totals": dict(self._cost_aware_totals)}
        torch.save(state, os.path.join(folder, STATE_FILE.format(rank=self.accelerator.process_index)))

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE.format(rank=self.accelerator.process_index))
        if os.path.exists(path):
            state = torch.load(path, weights_only=True)
            self._sampler_generator.set_state(state["generator"])
            self._cost_aware_totals.update(state["totals"])
