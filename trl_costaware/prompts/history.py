"""The prompt stage's state and draw: each prompt's reward history, and the sampler that draws the prompts of each
generation batch from it (no trainer in sight; the math is in `prompt_sampling.py`).

Every rank holds the same history and makes the same draws:

- the history is built from the rewards TRL gathers over all ranks (`PromptUpdate`, one per generation batch);
- draw t uses a generator seeded by (seed, t) alone, and the history as it was after applying the updates of
  generation batches ≤ t − lag, never "whatever has arrived": accelerate's loader draws one batch ahead of training,
  so batch t − 1's rewards may or may not be in when draw t happens, and a rank-dependent answer would split the
  ranks. Updates that arrive early wait in `pending`. With lag 2 (no loader workers) the update of t − 2 is always in.

A resumed run restores `applied`, `pending` and the posterior arrays, so draw t sees the same history as in the
uninterrupted run; the draws that TRL's fast-forward skips are made again and thrown away (their updates are in).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from ..core.sampling import stream_generator
from .sampling import (
    PRIOR,
    beta_binomial_pmf,
    draw_prompts,
    forget_and_update,
    greso_scores,
    group_value,
    prompt_distribution,
    success_counts,
    zero_variance_probability,
)

RULES = ("cost_aware", "greso")
KEEP_RECORDS = 32  # draws kept for the trainer to match its batches against (the loader is at most a few ahead)


@dataclass
class PromptUpdate:
    """What one generation batch taught: per drawn prompt (global order), its group's rewards and token counts."""

    draw: int
    indices: list[int]
    rewards: torch.Tensor  # (K, G) float
    completion_tokens: torch.Tensor  # (K,) mean generated tokens per row of the group
    prompt_tokens: torch.Tensor  # (K,)


@dataclass
class DrawRecord:
    """One draw: the prompts in yield order, their weights, inclusion probabilities and predicted P(zero variance)."""

    draw: int
    indices: list[int]
    weights: torch.Tensor  # (K,) float64; 1 for the biased GRESO rule
    inclusion: torch.Tensor  # (K,) π_j of the drawn prompts
    predicted_zero_variance: torch.Tensor  # (K,)
    predicted_cost: torch.Tensor  # (K,) ĉ_j (tokens per row)
    uniform_cost: float  # mean ĉ over the pool: a uniform draw's expected cost per row


class PromptHistory:
    """The per-prompt posterior (Beta pseudo-counts with forgetting), token means, and the draws made from them."""

    def __init__(
        self,
        size: int,
        num_generations: int,
        *,
        smoothing: float,
        forgetting: float,
        scale: str,
        seed: int,
        lag: int = 2,
        rule: str = "cost_aware",
        explore: float = 0.2,
    ):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.size, self.num_generations = int(size), int(num_generations)
        self.smoothing, self.forgetting, self.scale = smoothing, forgetting, scale
        self.seed, self.lag, self.rule, self.explore = int(seed), int(lag), rule, explore
        self.a = torch.full((size,), PRIOR[0], dtype=torch.float64)
        self.b = torch.full((size,), PRIOR[1], dtype=torch.float64)
        self.completion = torch.zeros(size, dtype=torch.float64)
        self.prompt = torch.zeros(size, dtype=torch.float64)
        self.seen = torch.zeros(size, dtype=torch.bool)
        self.last_zero_variance = torch.zeros(size, dtype=torch.bool)
        self.reward_range: tuple[float, float] | None = None
        self.applied = -1  # every update of a draw ≤ applied is in the arrays
        self.pending: dict[int, PromptUpdate] = {}
        self.records: OrderedDict[int, DrawRecord] = OrderedDict()
        self.taken = -1  # the latest draw the trainer matched

    # ------------------------------------------------------------------ updates
    def submit(self, update: PromptUpdate) -> None:
        """Queue a generation batch's update; applied when a draw first needs it (a re-generated batch replaces it)."""
        if update.draw > self.applied:
            self.pending[update.draw] = update

    def _apply(self, update: PromptUpdate) -> None:
        idx = torch.as_tensor(update.indices, dtype=torch.long)
        rewards = update.rewards.double()
        finite = rewards[torch.isfinite(rewards)]
        if finite.numel():
            low, high = float(finite.min()), float(finite.max())
            if self.reward_range is not None:
                low, high = min(low, self.reward_range[0]), max(high, self.reward_range[1])
            self.reward_range = (low, high)
        low, high = self.reward_range or (0.0, 1.0)
        successes = success_counts(rewards, low, high)
        g = rewards.shape[1]
        self.a[idx], self.b[idx] = forget_and_update(self.a[idx], self.b[idx], successes, g, self.forgetting)
        spread = torch.nan_to_num(rewards, nan=low)
        self.last_zero_variance[idx] = (spread.max(1).values - spread.min(1).values) <= 1e-12  # as TRL's zero std
        seen = self.seen[idx]
        mix = self.forgetting
        self.completion[idx] = torch.where(
            seen,
            mix * self.completion[idx] + (1 - mix) * update.completion_tokens.double(),
            update.completion_tokens.double(),
        )
        self.prompt[idx] = update.prompt_tokens.double()
        self.seen[idx] = True

    def apply_until(self, last: int) -> None:
        """Apply the updates of draws applied+1 .. `last` in order; a missing one is an error (ranks would split)."""
        for d in range(self.applied + 1, last + 1):
            update = self.pending.pop(d, None)
            if update is None:
                raise RuntimeError(
                    f"cost_aware_prompt_sampling: the rewards of generation batch {d} had not arrived when the "
                    f"prompts of batch {last + self.lag} were drawn (lag {self.lag}). The data loader reads further "
                    "ahead than the lag allows; use dataloader_num_workers=0."
                )
            self._apply(update)
            self.applied = d

    # ------------------------------------------------------------------ the draw
    def predictions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(v̂, P(zero variance), ĉ) of every prompt from the current arrays."""
        pmf = beta_binomial_pmf(self.a, self.b, self.num_generations)
        value = group_value(pmf, self.scale)
        zero = zero_variance_probability(pmf)
        tokens = self.prompt + self.completion
        mean_seen = float(tokens[self.seen].mean()) if self.seen.any() else 1.0
        cost = torch.where(self.seen, tokens, torch.tensor(mean_seen, dtype=torch.float64)).clamp(min=1.0)
        return value, zero, cost

    def distribution(self, value: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
        if self.rule == "greso":
            scores = greso_scores(self.last_zero_variance & self.seen, self.explore)
            return scores / scores.sum()
        return prompt_distribution(value, cost, self.smoothing)

    def draw(self, t: int, k: int) -> DrawRecord:
        """Draw t: apply the updates ≤ t − lag, then K prompts from q (generator seeded by (seed, t)). A draw that
        the Trainer's fast-forward throws away on resume applies nothing new (its updates are in already)."""
        self.apply_until(t - self.lag)
        value, zero, cost = self.predictions()
        q = self.distribution(value, cost)
        generator = stream_generator(self.seed, 0, f"prompts/{t}")
        draw = draw_prompts(q, k, generator)
        idx = draw.indices
        weights = draw.weights if self.rule == "cost_aware" else torch.ones(k, dtype=torch.float64)
        rec = DrawRecord(
            draw=t,
            indices=idx.tolist(),
            weights=weights,
            inclusion=draw.probabilities[idx],
            predicted_zero_variance=zero[idx],
            predicted_cost=cost[idx],
            uniform_cost=float(cost.mean()),
        )
        self.records[t] = rec
        while len(self.records) > KEEP_RECORDS:
            self.records.popitem(last=False)
        return rec

    def take_record(self, indices: list[int]) -> DrawRecord:
        """The draw a generation batch came from, given its global prompt order (every rank's rows, each prompt
        repeated G times): the draw after the last one taken, or that one again (TRL re-generates the batch it was
        training on when a run resumes mid-buffer), or a later one."""
        g = self.num_generations
        order = sorted(self.records, key=lambda t: (t != self.taken + 1, t != self.taken, t))
        for t in order:
            rec = self.records[t]
            if t >= self.taken and [j for j in rec.indices for _ in range(g)] == list(indices):
                self.taken = t
                return rec
        raise RuntimeError(
            "cost_aware_prompt_sampling: this generation batch's prompts match none of the prompt sampler's recent "
            "draws; the data loader did not read the sampler in order (a custom get_train_dataloader?)."
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        pending = {
            str(d): {
                "indices": torch.as_tensor(u.indices),
                "rewards": u.rewards,
                "completion_tokens": u.completion_tokens,
                "prompt_tokens": u.prompt_tokens,
            }
            for d, u in self.pending.items()
        }
        low, high = self.reward_range if self.reward_range is not None else (float("nan"), float("nan"))
        return {
            "a": self.a, "b": self.b, "completion": self.completion, "prompt": self.prompt, "seen": self.seen,
            "last_zero_variance": self.last_zero_variance, "reward_range": torch.tensor([low, high]),
            "applied": self.applied, "taken": self.taken, "pending": pending, "size": self.size,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if int(state["size"]) != self.size:
            raise ValueError(
                f"cost_aware_prompt_sampling: the checkpoint's prompt history covers {int(state['size'])} prompts, "
                f"this run's train_dataset has {self.size}: resume with the same data set."
            )
        for name in ("a", "b", "completion", "prompt", "seen", "last_zero_variance"):
            setattr(self, name, state[name].clone())
        low, high = state["reward_range"].tolist()
        self.reward_range = None if low != low else (low, high)
        self.applied, self.taken = int(state["applied"]), int(state["taken"])
        self.pending = {
            int(d): PromptUpdate(
                int(d), u["indices"].tolist(), u["rewards"], u["completion_tokens"], u["prompt_tokens"]
            )
            for d, u in state["pending"].items()
        }
        self.records.clear()


class PromptSampler(Sampler):
    """`RepeatSampler`'s layout (K prompts per generation batch, each repeated G times, the batch repeated R times
    for TRL's buffer), with the K prompts of each batch drawn by `PromptHistory.draw` instead of a permutation.

    Its length is `RepeatSampler`'s, so TRL's epochs and step counts are unchanged; an "epoch" is `len(dataset) // K`
    draws, not every prompt once. Draw numbers run on across epochs: t = epoch · C + c (`set_epoch`, which the
    Trainer calls before each epoch)."""

    def __init__(self, history: PromptHistory, mini_repeat_count: int, batch_size: int, repeat_count: int):
        self.history = history
        self.mini_repeat_count, self.batch_size, self.repeat_count = mini_repeat_count, batch_size, repeat_count
        self.num_samples = history.size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def draws_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def __iter__(self):
        per_epoch = self.draws_per_epoch()
        epoch = self.epoch
        for c in range(per_epoch):
            rec = self.history.draw(epoch * per_epoch + c, self.batch_size)
            for _ in range(self.repeat_count):
                for index in rec.indices:
                    for _ in range(self.mini_repeat_count):
                        yield index
        self.epoch = epoch + 1  # without set_epoch, the next iteration draws on

    def __len__(self) -> int:
        return self.draws_per_epoch() * self.batch_size * self.mini_repeat_count * self.repeat_count
