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
from .budget import AUTO, inflation_terms, smallest_budget
from .config import CostAwareGRPOConfig, resolve_cost_fn
from .diagnostics import batch_metrics, rank_sums
from .proxy import DEFAULT_GAMMA, row_factor
from .sampling import (
    capped_kept_count,
    draw_rows,
    eligible_rows,
    gradient_proxy,
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
        self._grouping_generator = torch.Generator().manual_seed(seed * 1_000_003 + self.accelerator.process_index + 7)
        self._deferred_passes = (False, False)
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
        with self._scoring_hooks() as scoring:
            batch = super()._generate_and_score_completions(inputs)
        batch["cost_aware_generated_tokens"] = self._generated_lengths(batch, scoring["generated"])
        if not self.args.cost_aware:
            self._record_generation(batch)
            return batch
        kept, factors = self._draw_kept_rows(batch)
        batch.pop("cost_aware_generated_tokens")
        advantages = batch["advantages"]
        # The sampler works on the host: its indices and factors move to the batch's device (and dtype) here.
        batch = select_rows(batch, kept.to(advantages.device))
        batch["advantages"] = batch["advantages"] * factors.to(device=advantages.device, dtype=advantages.dtype)
        # The deferred passes run per micro-batch, on the tensors the policy pass will see (_process_new_buffer).
        self._deferred_passes = self._passes_to_run(scoring["calls"], batch)
        return batch

    @contextmanager
    def _scoring_hooks(self):
        """While TRL scores a generation batch: record how many tokens each rollout generated (TRL's
        `mask_truncated_completions` zeroes the mask of truncated rows, but their tokens were generated), and, with
        cost_aware, skip its no-grad log-prob passes (old policy, reference) and record them, so they run afterwards on
        the kept rows only. With vLLM importance-sampling correction TRL needs the old log-probs of every row at once
        for its ratio, so that pass runs as usual."""
        record = {"calls": [], "generated": None}
        saved = {k: vars(self)[k] for k in ("_generate", "_get_per_token_logps_and_entropies") if k in vars(self)}
        generate = self._generate

        def recorded_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            record["generated"] = [len(ids) for ids in out[1]]  # (prompt_ids, completion_ids, ...)
            return out

        self._generate = recorded_generate
        if self.args.cost_aware:
            original = self._get_per_token_logps_and_entropies
            run_first = self.use_vllm and self.vllm_importance_sampling_correction
            calls = record["calls"]

            def deferred(model, *args, **kwargs):
                if run_first and not calls:
                    calls.append("computed")
                    return original(model, *args, **kwargs)
                calls.append("deferred")
                return None, None, None

            self._get_per_token_logps_and_entropies = deferred
        try:
            yield record
        finally:  # back to the class methods, or to whatever instance attributes were there before
            for name in ("_generate", "_get_per_token_logps_and_entropies"):
                vars(self).pop(name, None)
            vars(self).update(saved)

    def _generated_lengths(self, batch, recorded) -> torch.Tensor:
        """Generated completion tokens per row (on the batch's device): from `_generate` when it ran, else (a batch
        built another way) the completion mask."""
        mask = batch["completion_mask"]
        if recorded is None or len(recorded) != len(mask):
            return mask.sum(-1)
        return torch.tensor(recorded, device=mask.device)

    def _passes_to_run(self, calls, batch) -> tuple[bool, bool]:
        """(old policy, reference): which deferred passes TRL asked for. TRL runs the old-policy pass first (when
        needed), then the reference pass (when beta != 0).

        Under vLLM importance-sampling correction TRL ran the old-policy pass over every row, with the generation
        batch's padding, only to form its vLLM ratio (already in the batch). Those log-probs are dropped: when the
        clipped ratio needs old log-probs (steps misaligned, or num_iterations > 1) they are recomputed per kept
        micro-batch like any deferred pass; otherwise TRL uses the policy pass's own detached log-probs. Either way the
        ratio is exactly 1 at the first micro-step, as in TRL."""
        has_ref = self.beta != 0.0 and "deferred" in calls
        if calls[:1] == ["computed"]:
            batch.pop("old_per_token_logps", None)
            generate_every = self.args.steps_per_generation * self.num_iterations
            return self.args.gradient_accumulation_steps % generate_every != 0, has_ref
        return calls.count("deferred") - int(has_ref) == 1, has_ref

    def _compute_deferred_logps(self, chunk):
        """The old-policy / reference log-probs of one micro-batch, computed on the very tensors `_compute_loss` feeds
        the policy pass (same rows, padding, width and batch), so that at the first micro-step the ratio is exactly 1
        in any precision."""
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
                else:  # PEFT: the base model (adapters disabled) or an initial copy loaded as adapter "ref"
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    ref_model = self.model
                    context = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
                with context:
                    chunk["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                        ref_model, ids, mask, width
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
        (the only synchronisation of the sampler's host work; the cross-rank gathers below are collectives).

        `costs` come from the masks the loss sees (a row hidden by `mask_truncated_completions` costs its prompt
        only, and is outside the sampling support anyway); `rollout_lengths` = prompt + generated tokens, whatever the
        masks."""
        generated = batch.get("cost_aware_generated_tokens", batch["completion_mask"].sum(-1))
        columns = {
            "advantages": batch["advantages"].detach().float(),
            "costs": self._row_costs(batch).float(),
            "rollout_lengths": (batch["prompt_mask"].sum(-1) + generated).float(),
            "loss_tokens": self._loss_mask(batch).sum(-1).float(),
            "generated_tokens": generated.float(),
            "proxy_factors": self._proxy_factors(batch).float(),
        }
        host = torch.stack(list(columns.values()), dim=1).cpu()
        return dict(zip(columns, host.unbind(1), strict=True))

    def _proxy_factors(self, batch) -> torch.Tensor:
        """h_i of the "loss_aware" proxy G_i = |A_i| h_i (`proxy.row_factor`: the loss type's normaliser and the row's
        loss tokens, weighted by 1 − π(y_t) when the generator returned the sampled tokens' log-probabilities, as vLLM
        does); ones for the other proxies (G_i = |A_i|)."""
        mask = self._loss_mask(batch)
        if self.args.cost_aware_proxy != "loss_aware":
            return torch.ones(len(mask), device=mask.device)
        return row_factor(mask, self.loss_type, DEFAULT_GAMMA, batch.get("sampling_per_token_logps"))

    @property
    def _zero_advantage_carries_gradient(self) -> bool:
        """Whether a row with A = 0 still adds gradient: a KL term, an entropy bonus or a router aux loss."""
        return self.beta != 0.0 or self._entropy_bonus_enabled or bool(getattr(self, "aux_loss_enabled", False))

    def _kept_count(self, p, rows, eligible, device) -> int:
        """m for this generation batch, equal on every rank: the configured rule (fraction, or the token budget's
        count, smallest over ranks; or with `cost_aware_kept_fraction="auto"` the smallest m whose predicted variance
        inflation is ≤ δ, `budget.smallest_budget`, LARGEST over ranks so that every rank and the step stay within δ),
        capped by `capped_kept_count` at what the eligible rows of the busiest rank need. One gather of two integers
        when there are several ranks (and, with "auto", one of the inflation's two sums for the log)."""
        args, n = self.args, len(p)
        spg = args.steps_per_generation
        auto = args.cost_aware_kept_fraction == AUTO
        g = gradient_proxy(rows["advantages"], rows["proxy_factors"]) if auto else None
        if auto:
            m_local = smallest_budget(g, p, args.cost_aware_budget_delta, spg, args.cost_aware_draw)[0]
        elif args.cost_aware_token_budget is not None:
            m_local = kept_rows_for_token_budget(p, rows["costs"], args.cost_aware_token_budget, n)
        else:
            m_local = kept_row_count(n, args.cost_aware_kept_fraction, spg)
        sign = 1 if auto else -1  # gather the max of sign·m: the largest m for "auto", the smallest otherwise
        k_local = int(eligible.sum())
        if self.accelerator.num_processes > 1:
            both = self.accelerator.gather(torch.tensor([[sign * m_local, k_local]], device=device)).amax(0).tolist()
            m_rule, k_max = sign * both[0], both[1]
        else:
            m_rule, k_max = m_local, k_local
        m = capped_kept_count(kept_row_count(n, m_rule / n, spg), k_max, spg)
        if auto:  # the predicted inflation of the step: Σ_ranks numerator / Σ_ranks denominator (in G² units)
            num, den = inflation_terms(g, p, m, args.cost_aware_draw)
            total = self._sum_over_ranks({"num": num, "den": den}, device)
            inflation = total["num"] / total["den"] if total["den"] > 0 else 0.0
            self._metrics["train"]["cost_aware/budget_inflation"].append(inflation)
        return m

    def _draw_kept_rows(self, batch):
        """Draw the kept rows of this rank's generation batch; return their indices and advantage factors, both on
        the host (the caller moves them to the batch's device)."""
        args = self.args
        device = batch["advantages"].device
        rows = self._host_row_stats(batch)
        advantages, costs = rows["advantages"], rows["costs"]
        n = len(advantages)
        eligible = eligible_rows(advantages, rows["loss_tokens"], self._zero_advantage_carries_gradient)
        scores = sampling_scores(advantages, costs, args.cost_aware_proxy, rows["proxy_factors"])
        p = sampling_distribution(scores, args.cost_aware_smoothing, support=eligible)
        m = self._kept_count(p, rows, eligible, device)
        # Slots beyond the eligible rows (a rank with fewer of them than m) go to the cheapest rows the loss sees.
        filler = (rows["loss_tokens"] > 0).double() / costs.double().clamp(min=1.0)
        draw = draw_rows(p, m, args.cost_aware_draw, self._sampler_generator, filler=filler)

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

        full_tokens = rows["loss_tokens"].sum()
        kept_tokens = rows["loss_tokens"][draw.indices].sum()
        if self.loss_type in MICRO_TOKEN_MEAN_LOSSES:
            batch["cost_aware_full_tokens"] = full_tokens.to(device)
        if self.beta != 0.0 and self.loss_type in TOKEN_SUM_LOSSES:
            # The KL term is not importance-weighted (only the advantage carries the weight), so under a full-batch
            # token normaliser it would shrink with the kept tokens; this rescales it back to the full batch's size.
            batch["cost_aware_kl_scale"] = (full_tokens / kept_tokens.clamp(min=1)).to(device)

        local = rank_sums(
            advantages,
            costs,
            eligible,
            p,
            draw.indices,
            rows["rollout_lengths"],
            rows["generated_tokens"],
            rows["loss_tokens"],
            m,
        )
        total = self._sum_over_ranks(local, device)
        metrics = self._metrics["train"]
        for key, value in batch_metrics(total).items():
            metrics[f"cost_aware/{key}"].append(value)
        for key, value in stats.as_dict(prefix="cost_aware/weight_").items():
            metrics[key].append(value)
        self._add_totals(total["rows"], total["kept"], total["rollout_tokens"], total["generated_tokens"])
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
        generated = batch.pop("cost_aware_generated_tokens")
        total = self._sum_over_ranks(
            {
                "rows": len(batch["completion_mask"]),
                "rollout_tokens": float((batch["prompt_mask"].sum(-1) + generated).sum()),
                "generated_tokens": float(generated.sum()),
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
        chunk = self._processed_chunks.get(id(inputs))
        if chunk is None:
            raise RuntimeError(
                "CostAwareGRPOTrainer: the micro-batch TRL returned is not one of the buffered generation batch's "
                "chunks, so it was never trimmed, weighted or given its deferred log-probs. This TRL version indexes "
                "its buffer differently from the one this trainer supports."
            )
        return chunk

    def _process_new_buffer(self):
        """Runs once per generation batch, when TRL has just split it into micro-batches (before any update)."""
        chunks = list(self._buffered_inputs)
        if self.args.cost_aware:
            if self.args.cost_aware_group_by_length and len(chunks) > 1:
                # Its own generator: grouping changes padding only, never which rows the sampler draws next.
                chunks = regroup_by_length(chunks, self._grouping_generator)
            chunks = [trim_to_longest(c, self.pad_to_multiple_of) for c in chunks]
            if "cost_aware_full_tokens" in chunks[0]:
                # bnpo: replace each micro-batch's own token count by the full batch's mean micro-batch count.
                micro_full = chunks[0]["cost_aware_full_tokens"] / len(chunks)
                for c in chunks:
                    c["advantages"] = c["advantages"] * (self._loss_mask(c).sum() / micro_full).to(c["advantages"])
            for c in chunks:
                self._compute_deferred_logps(c)
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

    def _clip_grad_norm(self, model):
        """Records, per optimizer step, whether `max_grad_norm` clipped the gradient (`cost_aware/grad_clipped`, its
        window mean is the fraction of clipped steps), in both arms: the reweighted gradient is noisier than GRPO's."""
        norm = super()._clip_grad_norm(model)
        if norm is not None:
            clipped = float(torch.as_tensor(norm).float() > self.args.max_grad_norm)
            self._metrics["train"]["cost_aware/grad_clipped"].append(clipped)
        return norm

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
        state = {
            "generator": self._sampler_generator.get_state(),
            "grouping_generator": self._grouping_generator.get_state(),
            "totals": dict(self._cost_aware_totals),
        }
        torch.save(state, os.path.join(folder, STATE_FILE.format(rank=self.accelerator.process_index)))

    def _load_rng_state(self, checkpoint):
        super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE.format(rank=self.accelerator.process_index))
        if os.path.exists(path):
            state = torch.load(path, weights_only=True)
            self._sampler_generator.set_state(state["generator"])
            if "grouping_generator" in state:
                self._grouping_generator.set_state(state["grouping_generator"])
            self._cost_aware_totals.update(state["totals"])
