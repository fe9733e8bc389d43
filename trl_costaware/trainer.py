"""`CostAwareGRPOTrainer`: GRPO that trains on a cost-aware sample of each generation batch.

Mohri, Globerson, Kaplan, Koren, Mansour, "Cost-Aware Learning", arXiv 2604.28020 (2026); the method as built here is
stated in docs/algorithm.md, the path of one generation batch in docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from transformers import AutoProcessor, ProcessorMixin
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from .config import CostAwareGRPOConfig, resolve_cost_fn
from .rows import shared_prompt
from .rows.batching import KNOWN_KEYS, full_sequences, loss_mask, noop_micro_batch, row_lengths, select_rows
from .rows.deferred import DEFERRED_KEYS, VLLM_METRICS, deferred_passes, placeholder_logps, ratio_stats, scoring_window
from .rows.layout import kept_multiple, layout_for, optimizer_segments
from .rows.packed import MicroStep, even_buffer, noop_skippable, pack_buffer, token_weighted_means
from .rows.plan import (
    AcceleratorCollective,
    Plan,
    PlanSettings,
    RowStats,
    SingleProcess,
    check_loss_type,
    float64_bits,
    plan_batch,
    to_float64,
)
from .rows.proxy import DEFAULT_GAMMA, row_factor
from .rows.sampling import sequence_costs, stream_generator
from .rows.vllm_ratio import combine_ratio_stats, vllm_importance_sampling_ratio, vllm_metrics
from .tracking.callbacks import attach_tracking, validate_report_to
from .tracking.launch import duplicated_launch

STATE_FILE = "cost_aware_state_rank{rank}.pt"
MULTIMODAL_REFUSAL = (
    "cost_aware=True supports text-only models; this model has a multimodal processor whose image tensors are not "
    "per-row. Set cost_aware=False to train it with plain GRPO."
)


# The cumulative counters, global (summed over ranks), identical on every rank, saved in checkpoints. Generation
# counters are added when a generation batch is generated and drawn; trained counters when a micro-step trains.
GENERATION_COUNTERS = (
    "rollout_tokens",  # prompt + completion tokens of every generated rollout
    "generated_tokens",  # completion tokens of every generated rollout
    "rows_generated",
    "rows_kept",  # rows drawn for the update
)
TRAINED_COUNTERS = (
    "policy_tokens",  # real tokens of the micro-batches trained, each pass counted (shared prompts: as run)
    "policy_tokens_padded",  # rows × width of those micro-batches (a no-op counted where it runs the model)
)


@dataclass
class GenerationBatch:
    """One generation batch from its draw to its last micro-step: the random streams before its draw and the
    counters its generation and draw added (`generated`; a checkpoint inside it saves the streams and the totals
    without these, as TRL regenerates it on resume), its `plan` (None under `cost_aware=False`), its `kept` rows until
    laid out, then, per micro-step position, its `micro_batches` (TRL's buffer), what the loss needs of each
    (`micro_steps`), its planned shared pass (`shared_passes`; None without `shared_prompt_forward` or for a no-op),
    the counters each adds when it trains (`trained`) and a packed micro-batch's metric weights (loss tokens, rows)
    over all ranks (`metric_weights`)."""

    start_streams: dict
    generated: dict[str, float] = field(default_factory=dict)
    plan: Plan | None = None
    kept: dict | None = None
    micro_batches: list[dict] | None = None
    micro_steps: list[MicroStep] | None = None
    shared_passes: list[shared_prompt.SharedPass | None] | None = None
    trained: list[dict[str, float]] | None = None
    metric_weights: list[tuple[float, float]] | None = None

    def micro_step(self, position: int) -> MicroStep:
        """The `MicroStep` at micro-step `position` (`_step % steps_per_generation`, TRL's index into its buffer); a
        plain one for a batch not laid out here."""
        return self.micro_steps[position] if self.micro_steps else MicroStep()


@dataclass
class CostAwareState:
    """Everything the trainer keeps beyond `GRPOTrainer`'s attributes, in one attribute (`trainer._cost_aware`), so
    that no attribute TRL adds can collide with it: the micro-batch `layout` ("packed" or "even"), the user's cost
    callable (`cost_fn`, None for a built-in kind), the sampler's and grouping's random streams (independent, seeded
    by seed, rank and name), the global cumulative counters (`totals`), the generation batch being trained on, the
    deferred passes' flag (`rows.deferred.scoring_window`), the packed micro-batches' metric weights since the
    last train `log`, the reasons the shared-prompt forward fell back (each warned once) and the shared pass planned
    for the micro-batch whose log-probs are being computed (`_sharing`)."""

    layout: str
    cost_fn: Callable | None
    sampler: torch.Generator
    grouping: torch.Generator
    totals: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(GENERATION_COUNTERS + TRAINED_COUNTERS, 0.0)
    )
    generation: GenerationBatch | None = None
    deferring: bool | None = None
    metric_weights: list[tuple[float, float]] = field(default_factory=list)
    shared_fallbacks: set[str] = field(default_factory=set)
    shared_pass: shared_prompt.SharedPass | None = None


def text_only_processing_class(model, processing_class, args):
    """The processing class to hand `GRPOTrainer`, refusing a multimodal one before the model loads: the one given,
    or, for a model named by path or hub id, its processor loaded as TRL would load it (`AutoProcessor`, left padding
    and truncation), which reads no weights. For a model instance without one, TRL loads it and the trainer refuses
    after `GRPOTrainer.__init__`."""
    if processing_class is None and isinstance(model, str):
        processing_class = AutoProcessor.from_pretrained(
            model,
            revision=(args.model_init_kwargs or {}).get("revision"),
            truncation_side="left",
            padding_side="left",
            trust_remote_code=args.trust_remote_code,
        )
    if isinstance(processing_class, ProcessorMixin):
        raise NotImplementedError(MULTIMODAL_REFUSAL)
    return processing_class


class CostAwareGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for [`trl.GRPOTrainer`] implementing Cost-Aware GRPO.

    After TRL scores a generation batch, it draws m rows ∝ G_i/√c_i (smoothed; G_i the `cost_aware_proxy`), multiplies
    each kept row's advantage by its importance weight and hands the kept rows back to TRL, laid out in its own
    micro-batches (docs/layout.md); what crosses hooks for one generation batch is one `GenerationBatch`, and all the
    trainer's own state is one `CostAwareState` (`self._cost_aware`). Dropped rows cost nothing after generation: the
    old-policy and reference passes run on kept rows only, per micro-batch trimmed to its longest row. The path of one
    batch: docs/architecture.md. Hooks overridden: `_generate_and_score_completions` (draw, weights), `_generate` /
    `_calculate_rewards` / `_get_per_token_logps_and_entropies` (the deferred passes, `deferred.scoring_window`),
    `_prepare_inputs` (the layout, once per buffer; the trained counters, once per micro-step), `_compute_loss` (no-op
    micro-steps, β), `log` (counters), `_save_rng_state` / `_load_optimizer_and_scheduler` (the sampler's streams and
    the counters, so a resumed run draws and counts what the uninterrupted one would). Every TRL method and attribute
    it relies on: docs/architecture.md.

    Args: those of `GRPOTrainer.__init__`, with the same defaults; `args` must be a [`CostAwareGRPOConfig`] (a plain
    `GRPOConfig` is rejected).
    """

    _tag_names = ["trl", "grpo", "cost-aware"]
    _name = "CostAwareGRPO"
    _paper = {  # the model card cites this paper, not GRPO's
        "title": "Cost-Aware Learning",
        "id": "2604.28020",
        "citation": "@article{mohri2026costaware,\n    title  = {{Cost-Aware Learning}},\n    author = {Mehryar Mohri "
        "and Amir Globerson and Haim Kaplan and Tomer Koren and Yishay Mansour},\n    year   = 2026,\n    eprint = "
        "{arXiv:2604.28020}\n}",
    }

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: CostAwareGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            args = CostAwareGRPOConfig(f"{model_name.split('/')[-1]}-CostAwareGRPO")
        if not isinstance(args, CostAwareGRPOConfig):
            raise TypeError(
                f"args must be a CostAwareGRPOConfig, got {type(args).__name__}. Replace GRPOConfig(...) with "
                "CostAwareGRPOConfig(...): it accepts every GRPOConfig field."
            )
        if refusal := duplicated_launch(os.environ, args.world_size, args.use_cpu):  # N jobs of world 1 (launch.py)
            raise RuntimeError(refusal)
        if args.cost_aware:  # fail before the model loads
            check_loss_type(args.loss_type)
            processing_class = text_only_processing_class(model, processing_class, args)
        validate_report_to(args)
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        rank = self.accelerator.process_index
        # Independent streams (a hash of seed, rank and name): grouping never shifts which rows the sampler draws.
        self._cost_aware = CostAwareState(
            layout=layout_for(args, bool(self.aux_loss_enabled)) if args.cost_aware else "even",
            cost_fn=resolve_cost_fn(args.cost_aware_cost),
            sampler=stream_generator(args.seed, rank, "sampler"),
            grouping=stream_generator(args.seed, rank, "grouping"),
        )
        attach_tracking(self)  # local metrics record; W&B group and token x-axis (before TRL's WandbCallback)
        if args.cost_aware and isinstance(self.processing_class, ProcessorMixin):  # a model instance: TRL loaded it
            raise NotImplementedError(MULTIMODAL_REFUSAL)
        if args.shared_prompt_forward:
            self._check_shared_prompt()

    def _check_shared_prompt(self):
        """Refuses `shared_prompt_forward=True` where it cannot be exact (`shared_prompt.refusal`), for the policy
        and the reference model."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        peft_config = getattr(unwrapped, "active_peft_config", None)
        multimodal = isinstance(self.processing_class, ProcessorMixin)
        aux_loss = bool(getattr(self, "aux_loss_enabled", False))
        for model in (unwrapped, self.ref_model):
            if model is None:
                continue
            reason = shared_prompt.refusal(
                model.config, multimodal, aux_loss, bool(getattr(peft_config, "is_prompt_learning", False))
            )
            if reason is not None:
                raise ValueError(f"shared_prompt_forward=True cannot be exact here: {reason}. Set it to False.")

    # ------------------------------------------------------------------ generation batch: sample the rows
    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)  # evaluation is untouched
        self._cost_aware.generation = generation = GenerationBatch(self._stream_states())
        if not self.args.cost_aware:
            batch = super()._generate_and_score_completions(inputs)
            self._record_generation(batch)
            return batch
        with scoring_window(self._cost_aware):
            batch = super()._generate_and_score_completions(inputs)
        for key in DEFERRED_KEYS:  # placeholders (and TRL's ratio formed from them): recomputed on the kept rows
            batch.pop(key, None)
        generation.plan = plan = self._draw_kept_rows(batch)  # host tensors
        kept, factors = plan.indices, plan.factors
        advantages = batch["advantages"]
        batch = select_rows(batch, kept)  # host indices index the device tensors directly
        batch["advantages"] = batch["advantages"] * factors.to(device=advantages.device, dtype=advantages.dtype)
        # Each row's kept position, as a host list: TRL's shuffle and split carry it along with the rows, so each
        # micro-batch's rows (and their lengths, on the host) are known without reading the device.
        batch["cost_aware_rows"] = list(range(len(kept)))
        generation.kept = batch  # all m rows: TRL's split drops the last m mod S (the packed layout keeps them)
        return batch

    # The deferred passes (`deferred.scoring_window`): TRL's log-prob passes between generation and the rewards.
    def _generate(self, *args, **kwargs):
        out = super()._generate(*args, **kwargs)
        if self._cost_aware.deferring is False:  # inside the window: TRL's passes come next
            self._cost_aware.deferring = True
        return out

    def _calculate_rewards(self, *args, **kwargs):
        if self._cost_aware.deferring:
            self._cost_aware.deferring = False
        return super()._calculate_rewards(*args, **kwargs)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **kwargs,
    ):
        state = getattr(self, "_cost_aware", None)  # TRL's __init__ may call it before ours runs
        if state is not None and state.deferring:
            return placeholder_logps(input_ids, logits_to_keep)
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss)
        if state is not None and self.args.shared_prompt_forward:
            shared = self._shared_prompt_logps(*args, kwargs)
            if shared is not None:
                return shared
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _shared_prompt_logps(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, kwargs
    ):
        """`_get_per_token_logps_and_entropies` with each prompt group's prompt run once (`rows.shared_prompt`):
        (log-probs, entropies or None, None), or None where the unshared pass must run (nothing shared, or a
        batch the layout cannot reproduce: warned once per reason). The policy pass logs its token ratio
        (`cost_aware/shared_prompt_token_ratio`, 1 where it ran unshared)."""
        policy_pass = self.model.training and torch.is_grad_enabled()  # one token ratio per micro-step
        plan, reason = self._cost_aware.shared_pass, None
        if compute_aux_loss:
            reason = "the router aux loss averages over every token"
        elif any(value is not None for value in kwargs.values()):
            extra = sorted(k for k, v in kwargs.items() if v is not None)
            reason = f"the pass has model inputs beyond the text ({extra})"
        else:
            if plan is None or plan.mask.shape != attention_mask.shape:  # a pass outside the trainer's micro-steps
                plan = shared_prompt.plan_pass(input_ids, attention_mask, logits_to_keep)
            reason = plan.reason
        if reason is not None and reason not in self._cost_aware.shared_fallbacks:
            self._cost_aware.shared_fallbacks.add(reason)
            warnings.warn(f"shared_prompt_forward: running unshared where {reason}.", UserWarning, stacklevel=3)
        if reason is not None or not plan.shared:
            if policy_pass:
                self._metrics["train"]["cost_aware/shared_prompt_token_ratio"].append(1.0)
            return None
        config = self.accelerator.unwrap_model(model).config
        bias_dtype = None if config._attn_implementation == "sdpa" else torch.float32
        logps, entropies, tokens, unshared = shared_prompt.shared_forward(
            model,
            input_ids,
            plan.mask,
            logits_to_keep,
            plan.groups,
            bias_dtype=bias_dtype,
            compute_entropy=compute_entropy,
            batch_size=batch_size,
            autocast=self.accelerator.autocast,
        )
        if policy_pass:
            self._metrics["train"]["cost_aware/shared_prompt_token_ratio"].append(tokens / max(unshared, 1))
        return logps, entropies, None

    @contextmanager
    def _sharing(self, plan: shared_prompt.SharedPass | None):
        """The log-prob passes inside run with `plan`, their micro-batch's shared pass planned once (else each plans
        its own)."""
        self._cost_aware.shared_pass = plan
        try:
            yield
        finally:
            self._cost_aware.shared_pass = None

    def _row_costs(self, batch) -> torch.Tensor:
        cost_fn = self._cost_aware.cost_fn
        if cost_fn is not None:
            costs = torch.as_tensor(cost_fn(batch["prompt_mask"], batch["completion_mask"])).float()
            if costs.shape != (len(batch["completion_mask"]),):
                raise ValueError(f"cost_aware_cost callable must return one cost per row, got shape {costs.shape}")
            return costs.to(batch["completion_mask"].device)
        return sequence_costs(batch["prompt_mask"], batch["completion_mask"], self.args.cost_aware_cost)

    def _generated_lengths(self, batch) -> torch.Tensor:
        """Generated completion tokens per row, on the batch's device: the completion mask's length, or, for a row
        `mask_truncated_completions` hid (mask all 0; its last token is neither EOS nor padding, so it is the last
        non-padding token), the position of its last non-padding token."""
        mask, ids = batch["completion_mask"], batch["completion_ids"]
        lengths = mask.sum(-1)
        if not self.mask_truncated_completions:
            return lengths
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        positions = torch.arange(1, ids.size(1) + 1, device=ids.device)
        last = ((ids != tokenizer.pad_token_id) * positions).amax(-1)
        return torch.where(lengths > 0, lengths, last)

    def _host_row_stats(self, batch) -> RowStats:
        """The per-row scalars the plan needs, copied to the host in ONE device→host transfer per generation batch.

        `costs` come from the masks the loss sees (a row hidden by `mask_truncated_completions` costs its prompt
        only, and is outside the sampling support anyway); `rollout_lengths` = prompt + generated tokens, whatever the
        masks."""
        generated = self._generated_lengths(batch)
        prompt = batch["prompt_mask"].sum(-1)
        columns = {
            "advantages": batch["advantages"].detach().float(),
            "costs": self._row_costs(batch).float(),
            "loss_tokens": self._loss_mask(batch).sum(-1).float(),
            "proxy_factors": self._proxy_factors(batch).float(),
            "rollout_lengths": (prompt + generated).float(),
            "generated_tokens": generated.float(),
            "prompt_tokens": prompt.float(),
            "completion_tokens": batch["completion_mask"].sum(-1).float(),
        }
        host = torch.stack([columns[name] for name in RowStats.names()], dim=1).cpu()
        return RowStats(*host.unbind(1))

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

    def _collective(self, device):
        if self.accelerator.num_processes == 1:
            return SingleProcess()
        return AcceleratorCollective(self.accelerator, device)

    def _draw_kept_rows(self, batch) -> Plan:
        """The plan of this rank's generation batch (kept rows and their advantage factors, on the host): gathers the
        rows' statistics, calls `plan.plan_batch` once, logs its metrics and counters. A subclass may replace it with
        another row rule returning `Plan(indices, factors)`; the plan-only corrections then do not apply."""
        rows = self._host_row_stats(batch)
        args = self.args
        unit = kept_multiple(self._cost_aware.layout, args.steps_per_generation, args.gradient_accumulation_steps)
        settings = PlanSettings.from_args(args, self._zero_advantage_carries_gradient, unit)
        collective = self._collective(batch["advantages"].device)
        plan = plan_batch(rows, settings, self._cost_aware.sampler, collective)
        metrics = self._metrics["train"]
        for key, value in plan.metrics.items():
            metrics[f"cost_aware/{key}"].append(value)
        t = plan.totals
        self._add_generated(t["rows"], t["kept"], t["rollout_tokens"], t["generated_tokens"])
        return plan

    @staticmethod
    def _loss_mask(batch):
        return loss_mask(batch)

    def _sum_over_ranks(self, values: dict[str, float], device) -> dict[str, float]:
        """One gather of named scalars; returns their sums over ranks (identical on every rank). Single process: the
        values themselves (no device round trip)."""
        return self._collective(device).sum(values)

    def _add_generated(self, rows: float, kept: float, rollout_tokens: float, generated_tokens: float):
        """Adds a generation batch's generation counters (all ranks) to the totals and to its `generated`."""
        counts = dict(zip(GENERATION_COUNTERS, (rollout_tokens, generated_tokens, rows, kept), strict=True))
        generation = self._cost_aware.generation
        for key, value in counts.items():
            self._cost_aware.totals[key] += value
            if generation is not None:
                generation.generated[key] = generation.generated.get(key, 0.0) + value

    def _record_generation(self, batch):
        """Counters for a generation batch that is trained on in full (cost_aware=False): one transfer."""
        generated = self._generated_lengths(batch)
        prompt = batch["prompt_mask"].sum(-1)
        local = torch.stack([(prompt + generated).sum(), generated.sum()])
        rollout, gen = local.cpu().double().tolist()  # int64 sums: no float64 on the device
        values = {"rows": len(prompt), "rollout_tokens": rollout, "generated_tokens": gen}
        total = self._sum_over_ranks(values, prompt.device)
        self._add_generated(total["rows"], total["rows"], total["rollout_tokens"], total["generated_tokens"])
        self._metrics["train"]["cost_aware/kept_row_fraction"].append(1.0)
        self._metrics["train"]["cost_aware/kept_token_fraction"].append(1.0)

    # ------------------------------------------------------------------ micro-batches: trim, group, count
    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        buffer, state = self._buffered_inputs, self._cost_aware
        generation = state.generation
        if not self.model.training or buffer is None or generation is None:
            return inputs  # evaluation
        position = self._step % self.args.steps_per_generation  # TRL's own index into its buffer
        if buffer is not generation.micro_batches:
            # TRL has just generated and split a new generation batch: process all its micro-batches now, before any
            # update, and hand TRL the processed list. TRL's index, checked:
            if buffer[position] is not inputs:
                raise RuntimeError(
                    "CostAwareGRPOTrainer: the micro-batch TRL returned is not its buffer's entry at _step % "
                    "steps_per_generation, so it cannot be matched to its processed (trimmed, weighted) micro-batch. "
                    "This TRL version indexes its buffer differently from the one this trainer supports."
                )
            self._process_new_buffer()
        for key, value in generation.trained[position].items():  # this micro-step trains now
            state.totals[key] += value
        return self._buffered_inputs[position]

    def _process_new_buffer(self):
        """The one place where a generation batch's rows become its micro-batches. Runs once per generation batch,
        when TRL has just shuffled and split it (before any update): the layout (`packed.pack_buffer` in TRL's
        shuffled order, or `packed.even_buffer` on TRL's even split), the deferred passes, and the counters each
        micro-step adds when it trains; the result replaces TRL's buffer (one entry per micro-step position)."""
        chunks = list(self._buffered_inputs)
        generation = self._cost_aware.generation
        plan, kept_batch, generation.kept = generation.plan, generation.kept, None
        plan = plan if plan is not None and plan.totals is not None else None  # None: a row rule of a subclass's own
        host = plan.kept_stats if plan is not None else None
        if self._regroup_by_prompt(chunks, kept_batch):
            run = optimizer_segments(self.args.steps_per_generation, self.args.gradient_accumulation_steps)[1]
            chunks = shared_prompt.group_micro_batches(chunks, run)
        if not self.args.cost_aware:
            laid_out = [(c, MicroStep()) for c in chunks]
        elif kept_batch is not None and self._cost_aware.layout == "packed":
            laid_out = self._packed_chunks(kept_batch, chunks, host, plan)
        else:
            full = plan.micro_tokens_full if plan is not None else None
            laid_out = even_buffer(chunks, host, pad_to_multiple_of=self.pad_to_multiple_of, micro_tokens_full=full)
        chunks, steps = map(list, zip(*laid_out, strict=True))
        shared = [None] * len(chunks)
        if self.args.shared_prompt_forward:  # once per micro-batch, for its passes and its counts
            shared = [None if step.noop else shared_prompt.plan_pass(*full_sequences(c)) for c, step in laid_out]
        if self.args.cost_aware:
            for c, step, plan in zip(chunks, steps, shared, strict=True):
                if not step.noop:
                    with self._sharing(plan):
                        self._compute_deferred_logps(c)
        generation.micro_steps, generation.shared_passes = steps, shared
        # TRL-private write 1 of 4: TRL's `_prepare_inputs` indexes its `_buffered_inputs` by `_step` and has no hook
        # between its split and that index; the trainer's micro-batches (packed, trimmed) replace the buffer once
        # (test_trl_indexes_the_buffer_it_splits guards that code of TRL's).
        self._buffered_inputs = generation.micro_batches = chunks
        local = self._micro_step_counts(chunks, steps, shared)
        device = chunks[0]["completion_mask"].device
        if self.args.cost_aware and self.use_vllm and self.vllm_importance_sampling_correction:
            real = [c for c, step in zip(chunks, steps, strict=True) if not step.noop]
            summed = self._log_vllm_ratio(real, local, device)
        else:
            summed = self._sum_over_ranks(local, device)
        positions = range(len(chunks))
        generation.trained = [{k: summed[f"{k}/{p}"] for k in TRAINED_COUNTERS} for p in positions]
        generation.metric_weights = [(summed[f"metric_tokens/{p}"], summed[f"metric_rows/{p}"]) for p in positions]

    def _regroup_by_prompt(self, chunks, kept_batch) -> bool:
        """Whether TRL's micro-batches are re-split with each prompt's rows together (`shared_prompt_forward`, TRL's
        split or the even layout, a loss type whose optimizer step does not depend on the split
        (`REGROUPABLE_LOSSES`), no per-micro-batch entropy term, known batch keys). The packed layout groups its own
        rows (`pack_buffer`)."""
        if not self.args.shared_prompt_forward or self.loss_type not in shared_prompt.REGROUPABLE_LOSSES:
            return False
        if self._entropy_bonus_enabled or self.top_entropy_quantile < 1.0:
            return False
        if self.args.cost_aware and kept_batch is not None and self._cost_aware.layout == "packed":
            return False
        return all(key in KNOWN_KEYS for c in chunks for key in c)

    def _micro_step_counts(self, chunks, steps, shared) -> dict[str, float]:
        """This rank's counts per micro-step position p, named ``<name>/<p>`` (the same keys on every rank, so the
        ranks' one gather has one shape): `TRAINED_COUNTERS` (real tokens from the layout's host statistics, else
        one device→host copy for all micro-batches that lack them; padded tokens from shapes, a no-op counted where it
        runs the model; with `shared_prompt_forward`, the tokens its planned shared pass runs, `shared`) and a
        packed micro-batch's metric weights (loss tokens, rows; 0 elsewhere)."""
        skips = noop_skippable(self.accelerator)
        unknown = [p for p, step in enumerate(steps) if not step.noop and step.policy_tokens is None]
        measured = {}
        if unknown:
            sums = torch.stack([row_lengths(chunks[p]).sum() for p in unknown]).cpu().double().tolist()
            measured = dict(zip(unknown, sums, strict=True))
        local = {}
        for p, (c, step) in enumerate(zip(chunks, steps, strict=True)):
            tokens = 0.0 if step.noop else measured.get(p, step.policy_tokens)
            padded = 0 if step.noop and skips else c["prompt_ids"].numel() + c["completion_ids"].numel()
            if shared[p] is not None and shared[p].shared:  # what the shared policy pass runs
                tokens, padded = shared[p].tokens()
            weights = step.metric_weights or (0.0, 0.0)
            local.update({f"policy_tokens/{p}": tokens, f"policy_tokens_padded/{p}": float(padded)})
            local.update({f"metric_tokens/{p}": weights[0], f"metric_rows/{p}": weights[1]})
        return local

    def _packed_chunks(self, kept_batch, chunks, host, plan) -> list[tuple[dict, MicroStep]]:
        """`packed.pack_buffer` on this buffer: rows are assigned to optimizer steps in TRL's shuffled order (the
        chunks' kept positions, then the m mod S rows TRL's split left out, the whole order then shuffled with the
        grouping stream); lengths from the plan's host statistics (a subclass's own draw: one transfer each); with
        `shared_prompt_forward`, a prompt's rows packed together within each optimizer step."""
        m = len(kept_batch["cost_aware_rows"])
        seen = [i for c in chunks for i in c["cost_aware_rows"]]
        missing = sorted(set(range(m)) - set(seen))
        order = seen + missing
        if missing:
            order = [order[i] for i in torch.randperm(m, generator=self._cost_aware.grouping).tolist()]
        widths = None
        if host is not None:
            widths = (host["prompt_tokens"].tolist(), host["completion_tokens"].tolist())
            lengths = (host["prompt_tokens"] + host["completion_tokens"]).tolist()
            loss_tokens = host["loss_tokens"].tolist()
        else:
            lengths = row_lengths(kept_batch).cpu().tolist()
            loss_tokens = self._loss_mask(kept_batch).sum(-1).cpu().tolist()
        return pack_buffer(
            kept_batch,
            order,
            lengths,
            loss_tokens,
            loss_type=self.loss_type,
            steps_per_generation=self.args.steps_per_generation,
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            capacity=self.args.per_device_train_batch_size,
            fill=noop_skippable(self.accelerator),
            noop=noop_micro_batch(kept_batch),
            pad_to_multiple_of=self.pad_to_multiple_of,
            widths=widths,
            micro_tokens_full=plan.micro_tokens_full if plan is not None else None,
            groups=shared_prompt.group_ids(kept_batch) if self.args.shared_prompt_forward else None,
        )

    def _compute_deferred_logps(self, chunk):
        """The old-policy / reference log-probs of one kept micro-batch, computed on the very tensors `_compute_loss`
        feeds the policy pass (same rows, padding, width and batch), so that at the first micro-step the ratio is
        exactly 1 in any precision; with vLLM's correction, its importance-sampling ratio from them.

        The reference branch mirrors TRL's (`GRPOTrainer._generate_and_score_completions`, which has no helper for it):
        the reference model when there is one, else the PEFT model with adapters disabled, or with the adapter "ref"
        when TRL loaded an initial copy under that name."""
        vllm_is = self.use_vllm and self.vllm_importance_sampling_correction
        args = self.args
        has_old, has_ref = deferred_passes(
            args.gradient_accumulation_steps, args.steps_per_generation, self.num_iterations, vllm_is, self.beta
        )
        if not (has_old or has_ref):
            return
        ids, mask, width = full_sequences(chunk)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, args.gradient_checkpointing_kwargs):
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
        if vllm_is:
            chunk["importance_sampling_ratio"] = vllm_importance_sampling_ratio(
                chunk["old_per_token_logps"],
                chunk["sampling_per_token_logps"],
                self._loss_mask(chunk),
                mode=self.vllm_importance_sampling_mode,
                clip_min=self.vllm_importance_sampling_clip_min,
                clip_max=self.vllm_importance_sampling_clip_max,
            )

    def _log_vllm_ratio(self, chunks, local, device) -> dict[str, float]:
        """TRL's five vLLM metrics over the kept rows, reduced over ranks as TRL reduces them (`vllm_metrics`: means
        of per-rank means, extremes of per-rank extremes; their latest values, appended by TRL from the placeholder,
        are replaced), with the buffer's counts `local`: one gather (several processes) and one host copy. Returns
        the counts summed over ranks.

        Nothing float64 reaches the device: the statistics are float32 there (TRL's own precision for these metrics)
        and travel as their bit pattern, the float64 host counters as theirs (`plan.float64_bits`), both in one int64
        tensor. A rank with no real micro-batch sends the statistics of no token and joins the gather all the same."""
        sequence = self.vllm_importance_sampling_mode.startswith("sequence")
        stats = [ratio_stats(c, self._loss_mask(c), sequence) for c in chunks]
        reduced = combine_ratio_stats(torch.stack(stats) if stats else torch.empty((0, 7), device=device))
        counters = float64_bits(torch.tensor(list(local.values()), dtype=torch.float64))
        wire = torch.cat([reduced.view(torch.int32).to(torch.int64), counters.to(reduced.device)]).unsqueeze(0)
        if self.accelerator.num_processes > 1:
            wire = self.accelerator.gather(wire.to(device))
        wire = wire.cpu()
        r = wire[:, :7].to(torch.int32).view(torch.float32).double()
        # TRL-private write 2 of 4: TRL appended these five from the deferred (placeholder) pass, with no way to
        # recompute them; their latest values are replaced by the kept rows' values.
        metrics = self._metrics["train"]
        for key, value in zip(VLLM_METRICS, vllm_metrics(r), strict=True):
            if metrics[key]:
                metrics[key][-1] = value
            else:
                metrics[key].append(value)
        return dict(zip(local, to_float64(wire[:, 7:]).sum(0).tolist(), strict=True))

    def _compute_loss(self, model, inputs):
        """A no-op micro-step (packed layout) adds no gradient and no metric: a zero loss without the model where it
        may skip it (one process; DDP off the syncing micro-step, and the packed layout puts real micro-batches last),
        else zero times the policy's log-probs of its 1-token batch (DeepSpeed counts micro-steps, a syncing DDP step
        all-reduces), not TRL's loss, which would log it. A real micro-batch: TRL's loss with β scaled, here only, by
        the plan's `kl_scale` (a batch-token loss: the KL term is not importance-weighted, so under a full-batch token
        normaliser it would shrink with the kept tokens; T_full / T_kept restores it) times `MicroStep.beta_scale`
        (a packed micro-batch's share of its optimizer step's rows or tokens). β stays > 0 when it was, so TRL's
        `beta != 0` branches (and their collectives) run on every rank alike."""
        generation = self._cost_aware.generation
        if not self.model.training or generation is None:
            return super()._compute_loss(model, inputs)
        position = self._step % self.args.steps_per_generation  # as in `_prepare_inputs` (advanced after the step)
        step = generation.micro_step(position)
        if step.noop:
            if noop_skippable(self.accelerator) and (
                self.accelerator.num_processes == 1 or not self.accelerator.sync_gradients
            ):
                return torch.zeros((), device=inputs["completion_ids"].device, requires_grad=True)
            logps = self._get_per_token_logps_and_entropies(model, *full_sequences(inputs))[0]
            return logps.sum() * 0.0
        if step.metric_weights is not None:
            self._cost_aware.metric_weights.append(generation.metric_weights[position])
        kl_scale = generation.plan.kl_scale if generation.plan is not None else None
        # TRL-private write 3 of 4: TRL's `_compute_loss` reads β from `self.beta` only (no argument, no per-batch
        # key), so the per-micro-batch β multiplier is applied by setting it around the call and restoring it.
        beta = self.beta
        self.beta = beta * (kl_scale or 1.0) * step.beta_scale
        try:
            with self._sharing(generation.shared_passes[position] if generation.shared_passes else None):
                return super()._compute_loss(model, inputs)
        finally:
            self.beta = beta

    def _token_weighted_metrics(self):
        """At a train `log`, under the packed layout: TRL's per-micro-batch metric means of the window replaced by
        their means over the window's tokens or rows, summed over ranks (`packed.token_weighted_means`; the counts
        were summed over ranks when the buffer was laid out, so `log` runs no collective)."""
        state = self._cost_aware
        weights, state.metric_weights = state.metric_weights, []
        if not weights:
            return
        tokens, rows = [w[0] for w in weights], [w[1] for w in weights]
        per_row = self.args.importance_sampling_level == "sequence"
        # TRL-private write 4 of 4: TRL averages its per-micro-batch metric means unweighted at `log`; packed
        # micro-batches are unequal, so the window's entries are replaced by their token-weighted mean first.
        token_weighted_means(self._metrics["train"], tokens, rows, per_row)

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's `log` of a row that also carries the cumulative counters (on train and eval rows alike: eval curves
        against policy tokens). No collective, so a `log` called on one rank only returns. The callbacks and
        `log_history` get a row of their own, never changed afterwards; the caller's dict ends as `GRPOTrainer`
        leaves it (TRL's metrics added, what the callbacks removed removed), without any `cost_aware/` key it did not
        hold (counters, or the batch metrics of a window still open when training ends): `evaluate()` and `train()`
        return it, and a hyperparameter search sums every metric in it."""
        if self.model.training:
            self._token_weighted_metrics()  # packed micro-batches: means over the window's tokens (packed.py)
        counters = {f"cost_aware/{k}": v for k, v in self._cost_aware.totals.items()}
        row = {**logs, **{k: v for k, v in counters.items() if k not in logs}}
        super().log(row, start_time)
        for key in [k for k in logs if k not in row]:
            del logs[key]
        logs.update({k: v for k, v in row.items() if k in logs or not k.startswith("cost_aware/")})

    # ------------------------------------------------------------------ checkpoints
    def _stream_states(self) -> dict:
        return {
            "generator": self._cost_aware.sampler.get_state(),
            "grouping_generator": self._cost_aware.grouping.get_state(),
        }

    def _cost_aware_state(self) -> dict:
        """What a checkpoint saves beyond TRL's, per rank (`STATE_FILE`): the random streams, the global counters,
        the rank and world size that wrote it."""
        state = {}
        # Inside a buffer TRL regenerates it on resume (its buffer is not saved): the streams as they were before
        # that buffer's draw, so the regenerated draw uses the interrupted draw's stream and the rest of the run
        # continues the uninterrupted run's stream; and the totals without that buffer's generation counters, which
        # the regenerated buffer adds again (its micro-steps trained so far stay counted: they were trained).
        inside_buffer = self._step % (self.args.steps_per_generation * self.num_iterations) != 0
        generation = self._cost_aware.generation
        totals = dict(self._cost_aware.totals)
        if inside_buffer and generation is not None:
            state.update(generation.start_streams)
            for key, value in generation.generated.items():
                totals[key] -= value
        else:
            state.update(self._stream_states())
        state.update(
            totals=totals,
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
        )
        return state

    def _restore_cost_aware_state(self, state: dict):
        """Restores `_cost_aware_state`'s entries. `state` may be another rank's (`state["rank"]`, after a world-size
        change): the global counters are restored from it, this rank's random streams are not."""
        if state.get("rank", self.accelerator.process_index) == self.accelerator.process_index:
            if "generator" in state:
                self._cost_aware.sampler.set_state(state["generator"])
            if "grouping_generator" in state:
                self._cost_aware.grouping.set_state(state["grouping_generator"])
        if "totals" in state:
            self._cost_aware.totals.update(state["totals"])

    def _save_rng_state(self, output_dir):
        """Beside transformers' per-rank RNG state, inside `_save_checkpoint` and before it pushes the checkpoint to
        the hub: this rank's `STATE_FILE` (not written with `save_only_model`, which saves no RNG state either)."""
        super()._save_rng_state(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, STATE_FILE.format(rank=self.accelerator.process_index))
        torch.save(self._cost_aware_state(), path)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)  # once per resume, DeepSpeed included
        self._load_cost_aware_state(checkpoint)

    def _load_cost_aware_state(self, checkpoint):
        """On resume: this rank's `STATE_FILE`. Without it (a different world size, several nodes without a shared
        filesystem) one warning naming the file, and the counters stay monotone: rank 0's file (its counters are
        global; this rank's streams start afresh), else the last logged `cost_aware/*` counters
        of the checkpoint's trainer_state.json."""
        if checkpoint is None:
            return
        rank = self.accelerator.process_index
        path = os.path.join(checkpoint, STATE_FILE.format(rank=rank))
        if os.path.exists(path):
            self._restore_cost_aware_state(torch.load(path, weights_only=True))
            return
        fallback = os.path.join(checkpoint, STATE_FILE.format(rank=0))
        if rank != 0 and os.path.exists(fallback):
            self._restore_cost_aware_state(torch.load(fallback, weights_only=True))
            how = f"restored the global counters from {fallback}; this rank's sampler "
            how += "and grouping streams start afresh"
        else:
            restored = self._totals_from_log_history(checkpoint)
            if restored:
                self._cost_aware.totals.update(restored)
                how = "restored the cost_aware/* counters from the last values logged in its trainer_state.json"
            else:
                how = "found no logged cost_aware/* counters either: the counters restart at 0"
            how += "; the random streams start afresh"
        warnings.warn(
            f"Resuming from {checkpoint}: {path} not found (a different world size, or several nodes without a shared "
            f"filesystem?); {how}.",
            UserWarning,
            stacklevel=2,
        )

    def _totals_from_log_history(self, checkpoint) -> dict[str, float]:
        """The last logged value of each cumulative counter in the checkpoint's trainer_state.json ({} if none)."""
        try:
            with open(os.path.join(checkpoint, "trainer_state.json")) as f:
                history = json.load(f).get("log_history", [])
        except (OSError, ValueError):
            return {}
        found = {}
        for row in history:
            for key in self._cost_aware.totals:
                value = row.get(f"cost_aware/{key}")
                if isinstance(value, int | float):
                    found[key] = max(float(value), found.get(key, 0.0))
        return found
