"""The prompt stage's state and draw: each prompt's reward history, and the sampler that draws the prompts of each
generation batch from it (no trainer in sight; the math is in `sampling.py`).

Every rank holds the same history and makes the same draws:

- the history is built from the rewards TRL gathers over all ranks (`PromptUpdate`, one per generation batch);
- draw t uses a generator seeded by (seed, t) alone, and the history as it was after applying the updates of
  generation batches ≤ t − lag, never "whatever has arrived": accelerate's loader draws one batch ahead of training,
  so batch t − 1's rewards may or may not be in when draw t happens, and a rank-dependent answer would split the
  ranks. Updates that arrive early wait in `pending`. The lag is the smallest the Trainer's read-ahead allows
  (`stage.loader_lag`: an optimizer step's micro-batches are fetched at once, plus accelerate's one-batch prefetch).

Balanced epochs (rule "cost_aware"): q is frozen for an epoch of C = P // K draws, computed at the epoch's first draw
from the history then (the prior refitted on the pool), and all K·C slots are laid out in one systematic pass
(`sampling.epoch_layout`): each prompt is visited ⌊Cπ⌋ or ⌈Cπ⌉ times per epoch and each batch's inclusion
probabilities are exactly π. Only an epoch's first draw needs the lagged updates; the plan is saved with the history.

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
    epoch_layout,
    fit_prior,
    forget_and_update,
    greso_adapt,
    greso_keep_probability,
    greso_select,
    group_value,
    prompt_distribution,
    success_counts,
    zero_variance_probability,
)

RULES = ("cost_aware", "greso")
KEEP_RECORDS = 32  # draws kept for the trainer to match its batches against (the loader is at most a few ahead)
GRESO_START = 0.5  # GRESO's base keep probabilities (easy and hard) before any adaptation
GRESO_TARGETS = (0.125, 0.125)  # target shares of (easy, hard) zero-variance prompts per batch: 25% in all


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
    """The per-prompt posterior (a prior fitted on the pool plus evidence pseudo-counts that decay by γ per visit),
    token means, GRESO's counters, and the draws made from them.

    rule "cost_aware": balanced epochs of q ∝ v̂/√ĉ with Horvitz–Thompson weights; rule "greso" (a benchmark baseline,
    biased): GRESO's skip walk over the pool (`sampling.greso_keep_probability`), weights 1."""

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
        greso_targets: tuple[float, float] = GRESO_TARGETS,
    ):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.size, self.num_generations = int(size), int(num_generations)
        self.smoothing, self.forgetting, self.scale = smoothing, forgetting, scale
        self.seed, self.lag, self.rule = int(seed), int(lag), rule
        self.prior = PRIOR  # refitted on the pool at each epoch's plan (`fit_prior`)
        self.ea = torch.zeros(size, dtype=torch.float64)  # evidence pseudo-counts above the prior, decayed by γ
        self.eb = torch.zeros(size, dtype=torch.float64)
        self.last_success = torch.zeros(size, dtype=torch.float64)  # the latest visit's success share
        self.completion = torch.zeros(size, dtype=torch.float64)
        self.prompt = torch.zeros(size, dtype=torch.float64)
        self.seen = torch.zeros(size, dtype=torch.bool)
        self.last_zero_variance = torch.zeros(size, dtype=torch.bool)
        self.streak = torch.zeros(size, dtype=torch.long)  # consecutive zero-variance visits (GRESO's n)
        self.easy = torch.zeros(size, dtype=torch.bool)  # the latest zero-variance visit was all-correct
        self.greso_p = [GRESO_START, GRESO_START]  # (easy, hard)
        self.greso_targets = tuple(float(x) for x in greso_targets)
        self.queue: list[int] = []  # GRESO's walk over the pool
        self.refills = 0
        self.plan_epoch = -1  # the balanced epoch laid out (rule "cost_aware")
        self.plan: dict[str, torch.Tensor] = {}
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
        self.ea[idx], self.eb[idx] = forget_and_update(
            self.ea[idx], self.eb[idx], successes, g, self.forgetting, prior=(0.0, 0.0)
        )
        self.last_success[idx] = successes / g
        spread = torch.nan_to_num(rewards, nan=low)
        zero = (spread.max(1).values - spread.min(1).values) <= 1e-12  # as TRL's zero std
        easy = zero & (successes >= g / 2)
        self.last_zero_variance[idx] = zero
        self.streak[idx] = torch.where(zero, self.streak[idx] + 1, torch.zeros_like(self.streak[idx]))
        self.easy[idx] = torch.where(zero, easy, self.easy[idx])
        if self.rule == "greso" and len(idx):
            shares = (float(easy.double().mean()), float((zero & ~easy).double().mean()))
            self.greso_p = [
                greso_adapt(p, s, t) for p, s, t in zip(self.greso_p, shares, self.greso_targets, strict=True)
            ]
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
                    f"prompts of batch {last + self.lag} were drawn (lag {self.lag}, from "
                    "gradient_accumulation_steps, steps_per_generation, num_iterations and dataloader_num_workers: "
                    "stage.loader_lag). The data "
                    "loader read further ahead than that (a custom get_train_dataloader or sampler?)."
                )
            self._apply(update)
            self.applied = d

    # ------------------------------------------------------------------ the draw
    @property
    def a(self) -> torch.Tensor:
        """The posterior's success pseudo-counts: the pool's prior a₀ plus the decayed evidence."""
        return self.prior[0] + self.ea

    @property
    def b(self) -> torch.Tensor:
        return self.prior[1] + self.eb

    def refit_prior(self) -> None:
        """The prior fitted on the pool (`fit_prior`) from the seen prompts' latest visits; uniform before two."""
        seen = self.seen
        if int(seen.sum()) >= 2:
            self.prior = fit_prior(self.last_success[seen] * self.num_generations, self.num_generations)

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
        """q of the cost-aware rule (`prompt_distribution`)."""
        return prompt_distribution(value, cost, self.smoothing)

    def draws_per_epoch(self, k: int) -> int:
        return max(self.size // k, 1)

    def _plan_epoch(self, epoch: int, k: int) -> None:
        """Lay out epoch `epoch` (draws epoch·C .. epoch·C + C − 1): apply the updates ≤ epoch·C − lag, refit the
        prior, freeze q, and lay out its K·C slots in one systematic pass (generator seeded by (seed, epoch))."""
        per_epoch = self.draws_per_epoch(k)
        self.apply_until(epoch * per_epoch - self.lag)
        self.refit_prior()
        value, zero, cost = self.predictions()
        q = self.distribution(value, cost)
        indices, pi = epoch_layout(q, k, per_epoch, stream_generator(self.seed, 0, f"prompts/epoch{epoch}"))
        self.plan_epoch = epoch
        self.plan = {"indices": indices, "inclusion": pi, "zero": zero, "cost": cost}

    def _draw_greso(self, t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GRESO's walk: prompts off a queue of pool permutations, each kept with max(pⁿ, 1%) until K are kept."""
        self.apply_until(t - self.lag)
        keep = greso_keep_probability(self.streak, self.easy, *self.greso_p)
        generator = stream_generator(self.seed, 0, f"prompts/{t}")
        kept: list[int] = []
        while len(kept) < k:
            if not self.queue:
                refill = stream_generator(self.seed, 0, f"prompts/greso_queue{self.refills}")
                self.queue = torch.randperm(self.size, generator=refill).tolist()
                self.refills += 1
            taken = set(kept)
            order = torch.tensor([j for j in self.queue if j not in taken], dtype=torch.long)
            if not len(order):
                self.queue = []
                continue
            sel, consumed = greso_select(order, keep, k - len(kept), generator)
            kept += sel.tolist()
            self.queue = order[consumed:].tolist()
        return torch.tensor(kept, dtype=torch.long), keep

    def draw(self, t: int, k: int) -> DrawRecord:
        """Draw t. Rule "cost_aware": row t mod C of epoch t // C's layout (laid out at the epoch's first draw, or
        restored from a checkpoint), weights K / (P π_j). Rule "greso": GRESO's walk, weights 1."""
        if self.rule == "greso":
            idx, keep = self._draw_greso(t, k)
            _, zero, cost = self.predictions()
            weights, inclusion = torch.ones(k, dtype=torch.float64), keep[idx]
        else:
            epoch, c = divmod(t, self.draws_per_epoch(k))
            if epoch != self.plan_epoch or self.plan["indices"].shape[1] != k:
                self._plan_epoch(epoch, k)
            idx, zero, cost = self.plan["indices"][c], self.plan["zero"], self.plan["cost"]
            inclusion = self.plan["inclusion"][idx]
            weights = k / (self.size * inclusion)
        rec = DrawRecord(
            draw=t,
            indices=idx.tolist(),
            weights=weights,
            inclusion=inclusion,
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
            "ea": self.ea, "eb": self.eb, "prior": torch.tensor(self.prior, dtype=torch.float64),
            "last_success": self.last_success, "completion": self.completion, "prompt": self.prompt,
            "seen": self.seen, "last_zero_variance": self.last_zero_variance, "streak": self.streak,
            "easy": self.easy, "greso_p": torch.tensor(self.greso_p, dtype=torch.float64),
            "queue": torch.tensor(self.queue, dtype=torch.long), "refills": self.refills,
            "plan_epoch": self.plan_epoch, "plan": dict(self.plan),
            "reward_range": torch.tensor([low, high]),
            "applied": self.applied, "taken": self.taken, "pending": pending, "size": self.size,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if int(state["size"]) != self.size:
            raise ValueError(
                f"cost_aware_prompt_sampling: the checkpoint's prompt history covers {int(state['size'])} prompts, "
                f"this run's train_dataset has {self.size}: resume with the same data set."
            )
        names = ("ea", "eb", "last_success", "completion", "prompt", "seen", "last_zero_variance", "streak", "easy")
        for name in names:
            setattr(self, name, state[name].clone())
        self.prior = tuple(state["prior"].tolist())
        self.greso_p = state["greso_p"].tolist()
        self.queue, self.refills = state["queue"].tolist(), int(state["refills"])
        self.plan_epoch, self.plan = int(state["plan_epoch"]), {k: v.clone() for k, v in state["plan"].items()}
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
