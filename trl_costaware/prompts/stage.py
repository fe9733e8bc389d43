"""The prompt stage's trainer mixin: draws each generation batch's prompts with `PromptSampler` and weights their rows.

Wiring only; the math is in `sampling.py` and the state in `history.py` (docs/prompt_sampling.md).
With `cost_aware_prompt_sampling=True`:

- the train dataset gets a column `cost_aware_prompt_index` (its row index) at construction, and TRL's train
  sampler is replaced by `PromptSampler` (the eval sampler is untouched). An `IterableDataset` has no index to key a
  history on and is refused;
- per training generation batch the column is stripped before TRL sees the inputs (reward functions never get it),
  TRL generates and scores as usual, and then, on every rank alike: one gather of the rows' prompt index and token
  counts, the draw matched (`PromptHistory.take_record`), the update queued, and each row's advantage multiplied by
  its prompt's weight w_j = K / (P π_j) (times the token normaliser's correction for losses divided by the batch's
  tokens). The row sampler (`cost_aware=True`) then runs on the weighted advantages, so its proxy sees w_j |A_i|.
"""

from __future__ import annotations

import torch

from ..core.sampling import effective_sample_size
from .history import PromptHistory, PromptSampler, PromptUpdate
from .sampling import token_normaliser_factor

INDEX_COLUMN = "cost_aware_prompt_index"
PROMPT_TOTAL = "prompt_generated_tokens_saved"
# Losses divided by the generation batch's (or micro-batch's) tokens: their normaliser follows q (plan.py's
# LOSS_NORMALISERS with rows=False); the others are per row or constant, so the prompt weight alone is exact.
BATCH_TOKEN_LOSSES = ("dapo", "cispo", "vespo", "bnpo")


def zero_variance(rewards: torch.Tensor) -> torch.Tensor:
    """Per group (rows of `rewards`): every reward equal (NaN rewards count as equal to each other)."""
    r = torch.nan_to_num(rewards.double(), nan=0.0)
    return (r.max(1).values - r.min(1).values) <= 1e-12


def with_index_column(dataset):
    """`dataset` (a `datasets.Dataset`) with its row index in `INDEX_COLUMN`; a ValueError for anything without one."""
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        raise ValueError(
            "cost_aware_prompt_sampling=True needs a map-style datasets.Dataset as train_dataset (its history is "
            f"keyed on the row index); got {type(dataset).__name__}. An IterableDataset has no index: set "
            "cost_aware_prompt_sampling=False for streaming data."
        )
    if INDEX_COLUMN in dataset.column_names:
        dataset = dataset.remove_columns(INDEX_COLUMN)
    return dataset.add_column(INDEX_COLUMN, list(range(len(dataset))))


def loader_lag(args) -> int:
    """Draws between a generation batch's draw and the first draw allowed to see its rewards, counted in generation
    batches: L = ⌈(A + 1 + W) / R⌉ (at least 1), with

    - R = steps_per_generation × num_iterations: loader batches per generation batch (TRL repeats each one R times;
      draw d is made when loader batch d·R is read);
    - A = gradient_accumulation_steps: the Trainer fetches an optimizer step's A loader batches before training on
      any of them, and accelerate's loader reads one more ahead (the + 1), so draw d is made at the start of the
      optimizer step holding loader batch d·R − 1, when only generation batches d' with d'·R ≤ d·R − A − 1 are in;
    - W = dataloader_num_workers × dataloader_prefetch_factor: the batches loader workers may hold in advance.

    spg = A (TRL's default): 2; spg = 1, A = 2: 3; spg ≥ A + 1: 1 (the previous batch's rewards are always in)."""
    repeats = max(int(args.steps_per_generation or args.gradient_accumulation_steps) * int(args.num_iterations), 1)
    workers = int(args.dataloader_num_workers or 0)
    ahead = int(args.gradient_accumulation_steps) + 1 + workers * int(args.dataloader_prefetch_factor or 2)
    return max(1, -(-ahead // repeats))


class PromptStage:
    """Mixin for `CostAwareGRPOTrainer` (before `GRPOTrainer` in the bases)."""

    def __init__(self, *args, **kwargs):
        config = kwargs.get("args")
        enabled = bool(getattr(config, "cost_aware_prompt_sampling", False))
        if enabled:
            kwargs["train_dataset"] = with_index_column(kwargs.get("train_dataset"))
        super().__init__(*args, **kwargs)
        self._prompt_history = None
        self._prompt_rewards = None
        if enabled:
            a = self.args
            self._prompt_history = PromptHistory(
                len(self.train_dataset),
                self.num_generations,
                smoothing=a.cost_aware_prompt_smoothing,
                forgetting=a.cost_aware_prompt_forgetting,
                scale=a.scale_rewards,
                seed=a.seed,
                lag=loader_lag(a),
            )

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        # remove_unused_columns=True keeps only the signature columns: the index must survive it
        if getattr(self, "_prompt_history", None) is not None and INDEX_COLUMN not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, INDEX_COLUMN]

    def _get_train_sampler(self, dataset=None):
        if self._prompt_history is None:
            return super()._get_train_sampler(dataset)
        return PromptSampler(
            self._prompt_history,
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.model.training:
            self._prompt_rewards = rewards_per_func  # gathered over ranks by TRL
        return rewards_per_func

    def _group_rewards(self) -> torch.Tensor:
        """The generation batch's rewards (every rank's rows) as TRL sums them, (groups, G), on the host."""
        if self._prompt_rewards is None:
            raise RuntimeError(
                "cost_aware_prompt_sampling: TRL's _calculate_rewards was not called for this generation batch, so "
                "the prompt history has no rewards to learn from (a custom rollout path?)."
            )
        weights = self.reward_weights.to(self._prompt_rewards.device).unsqueeze(0)
        return (self._prompt_rewards * weights).nansum(dim=1).float().cpu().view(-1, self.num_generations)

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        self._prompt_rewards = None
        if self._prompt_history is None:
            batch = super()._generate_and_score_completions(inputs)
            if self._prompt_rewards is not None:  # (a rollout path without TRL's rewards logs nothing here)
                self._log_zero_variance_share(batch)
            return batch
        local = [int(x[INDEX_COLUMN]) for x in inputs]
        inputs = [{k: v for k, v in x.items() if k != INDEX_COLUMN} for x in inputs]
        batch = super()._generate_and_score_completions(inputs)
        self._weight_prompts(batch, local)
        return batch

    def _log_zero_variance_share(self, batch) -> None:
        """`cost_aware/zero_variance_token_share` without the prompt stage: the share of the generation batch's
        generated tokens (all ranks) in groups whose rewards are all equal. The flags come from TRL's gathered
        rewards; the token sums from one gather of two named sums (none with one process), so every rank logs the
        same value."""
        zero = zero_variance(self._group_rewards())
        n = len(batch["advantages"])
        start = self.accelerator.process_index * n
        flags = zero.repeat_interleave(self.num_generations)[start : start + n]
        generated = self._generated_lengths(batch).cpu().double()  # float64 on the host only (MPS has none)
        local = {"zero_variance_tokens": float(generated[flags].sum()), "tokens": float(generated.sum())}
        total = self._sum_over_ranks(local, batch["advantages"].device)
        share = total["zero_variance_tokens"] / max(total["tokens"], 1.0)
        self._metrics["train"]["cost_aware/zero_variance_token_share"].append(share)

    def _weight_prompts(self, batch, local: list[int]) -> None:
        """Match the draw, queue its update, weight the rows' advantages, log (one gather, identical on all ranks)."""
        history, g = self._prompt_history, self.num_generations
        device = batch["advantages"].device
        rows = torch.stack(
            [
                torch.as_tensor(local, device=device),
                batch["prompt_mask"].sum(-1),
                self._generated_lengths(batch),
                self._loss_mask(batch).sum(-1),
            ],
            dim=1,
        ).long()
        if self.accelerator.num_processes > 1:
            rows = self.accelerator.gather(rows)
        rows = rows.cpu()
        record = history.take_record(rows[:, 0].tolist())
        k = len(record.indices)
        rewards = self._group_rewards()
        generated = rows[:, 2].double().view(k, g)
        history.submit(
            PromptUpdate(record.draw, record.indices, rewards, generated.mean(1), rows[:, 1].view(k, g)[:, 0])
        )

        w = record.weights.double()
        norm = 1.0
        if self.loss_type in BATCH_TOKEN_LOSSES:
            norm = token_normaliser_factor(w, rows[:, 3].double().view(k, g).sum(1))
        factor = w.repeat_interleave(g) * norm
        n = len(local)
        start = self.accelerator.process_index * n
        mine = factor[start : start + n].to(device=device, dtype=batch["advantages"].dtype)
        batch["advantages"] = batch["advantages"] * mine

        zero = zero_variance(rewards)
        gen_group = generated.sum(1)
        saved = float((w * gen_group).sum() - gen_group.sum())  # a uniform draw's HT-estimated tokens − these
        totals = self._cost_aware_totals
        totals[PROMPT_TOTAL] = totals.get(PROMPT_TOTAL, 0.0) + saved
        predicted = record.predicted_zero_variance
        metrics = self._metrics["train"]
        for key, value in {
            "zero_variance_token_share": float(gen_group[zero].sum() / gen_group.sum().clamp(min=1)),
            "prompt_zero_variance_groups": float(zero.double().mean()),
            "prompt_predicted_zero_variance": float(predicted.mean()),
            "prompt_zero_variance_brier": float(((predicted - zero.double()) ** 2).mean()),
            "prompt_weight_ess_fraction": effective_sample_size(w) / k,
            "prompt_weight_max": float(w.max()),
            "prompt_weight_min": float(w.min()),
            "prompt_tokens_saved_batch": saved,
            "prompt_token_normaliser": norm,
        }.items():
            metrics[f"cost_aware/{key}"].append(value)

    # ------------------------------------------------------------------ checkpoints (the trainer's state hooks)
    def _cost_aware_state(self) -> dict:
        """The trainer's checkpoint state plus the prompt history (global: identical on every rank)."""
        base = getattr(super(), "_cost_aware_state", None)
        state = base() if base is not None else {}
        if self._prompt_history is not None:
            state["prompt_history"] = self._prompt_history.state_dict()
        return state

    def _restore_cost_aware_state(self, state: dict) -> None:
        base = getattr(super(), "_restore_cost_aware_state", None)
        if base is not None:
            base(state)
        if self._prompt_history is not None and "prompt_history" in state:
            self._prompt_history.load_state_dict(state["prompt_history"])
