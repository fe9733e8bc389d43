"""How the kept rows of a generation batch are laid out into micro-batches (pure arithmetic; docs/layout.md).

TRL splits each rank's generation batch of N = B · S rows (B = `per_device_train_batch_size`, S =
`steps_per_generation`) into S micro-batches of B rows. Cost-aware sampling keeps m of them. Two layouts, chosen by the
trainer (`layout_for`; the packed one unless a loss term is added per micro-batch):

- "even" (TRL's split of the m rows): m/S rows in every micro-step, so m is a multiple of S (at B = 1 nothing can be
  dropped) and every micro-step still runs, with fewer rows.
- "packed" (`packed_micro_steps`): each optimizer step's kept rows,
  sorted by length, in as few micro-batches of up to B rows as they need; the optimizer step's other micro-steps are
  no-ops. m is a multiple of k = S / gcd(S, G) only (G = `gradient_accumulation_steps`; `kept_multiple`): the
  number of runs of g = gcd(S, G) micro-step positions the generation batch is cut into (`optimizer_segments`), each
  inside one optimizer step. That is the number of optimizer steps per generation batch when G divides S, and 1
  (any m) when S divides G.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .sampling import kept_row_count


def optimizer_segments(steps_per_generation: int, gradient_accumulation_steps: int) -> tuple[int, int]:
    """(count, length) of the runs the S micro-step positions of a generation batch are cut into, g = gcd(S, G) long:

        count = S / g,   length = g.

    TRL runs position p = step mod S at micro-step `step`, and an optimizer step ends after every G-th micro-step;
    a generation batch starts at a multiple of S (S · num_iterations), so the positions at which an optimizer step
    can start, over all passes, are the multiples of g: a run never straddles two optimizer steps, and an optimizer
    step covers G / g whole runs. With S = k·G (k optimizer steps per generation batch) the runs are the k optimizer
    steps; with G = k·S (one optimizer step over k generation batches) there is one run, the whole buffer."""
    g = math.gcd(steps_per_generation, gradient_accumulation_steps)
    return steps_per_generation // g, g


def kept_multiple(layout: str, steps_per_generation: int, gradient_accumulation_steps: int) -> int:
    """What m must be a multiple of: S for the even layout (each micro-step gets m/S rows); for the packed layout the
    number of runs S/g (`optimizer_segments`), so each run, hence each optimizer step, gets the same q = m·g/S ≥ 1
    rows (an optimizer step of no-ops only would still move Adam's state). With S = G that is 1: any m."""
    if layout == "even":
        return steps_per_generation
    return optimizer_segments(steps_per_generation, gradient_accumulation_steps)[0]


def pack_sorted(lengths: Sequence[float], capacity: int, groups: Sequence[int] | None = None) -> list[list[int]]:
    """The indices of `lengths` in as few micro-batches of at most `capacity` rows as they need, n = ⌈k/capacity⌉:
    rows sorted longest first (stable), cut into contiguous groups of sizes

        [k − (n − 1)·capacity, capacity, ..., capacity]

    (the one short group takes the longest rows, so fewer rows are padded to the longest; with `groups`, a prompt
    group id per row, rows of a group stay together: `_cut_sorted`). The sizes depend on k and
    `capacity` only, never on the lengths: every rank packs the same k rows into micro-batches of the same sizes, which
    TRL's loss needs (it gathers per-row tensors of each micro-batch across ranks). Returns [] for no rows."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    k = len(lengths)
    if k == 0:
        return []
    n = -(-k // capacity)
    first = k - (n - 1) * capacity
    return _cut_sorted(lengths, [first] + [capacity] * (n - 1), groups)


def spread_sorted(lengths: Sequence[float], count: int, groups: Sequence[int] | None = None) -> list[list[int]]:
    """The indices of `lengths` in n = min(k, count) micro-batches of sizes as equal as possible: rows sorted longest
    first (stable), cut into contiguous groups of sizes [a, ..., a, a + 1, ..., a + 1] (a = ⌊k/n⌋; the k mod n
    groups of a + 1 rows last). For a layout where every micro-step position runs a forward anyway (a no-op still
    runs one under DeepSpeed): the same positions filled, fewer rows per forward, and among all partitions into groups
    of a rows the sorted one pads least, group by group. The sizes depend on k and `count` only (equal on every
    rank). Returns [] for no rows."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    k = len(lengths)
    if k == 0:
        return []
    n = min(k, count)
    a, extra = divmod(k, n)
    return _cut_sorted(lengths, [a] * (n - extra) + [a + 1] * extra, groups)


def _cut_sorted(
    lengths: Sequence[float], sizes: Sequence[int], groups: Sequence[int] | None = None
) -> list[list[int]]:
    """Rows sorted longest first (stable), cut into contiguous runs of `sizes`. With `groups` (a prompt group id per
    row): groups by their longest row, longest first, each group's rows together, longest first (the shared-prompt
    forward runs a group's prompt once per micro-batch it is in)."""
    if groups is None:
        order = sorted(range(len(lengths)), key=lambda i: -float(lengths[i]))
    else:
        longest: dict[int, float] = {}
        for i, g in enumerate(groups):
            longest[g] = max(longest.get(g, float("-inf")), float(lengths[i]))
        order = sorted(range(len(lengths)), key=lambda i: (-longest[groups[i]], groups[i], -float(lengths[i])))
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def packed_micro_steps(
    order: Sequence[int],
    lengths: Sequence[float],
    steps_per_generation: int,
    gradient_accumulation_steps: int,
    capacity: int,
    fill: bool = True,
    groups: Sequence[int] | None = None,
) -> list[list[int] | None]:
    """The packed layout of one generation batch: for each of the S micro-step positions, the kept rows it trains on
    (positions into the kept batch), or None for a no-op.

    `order`: the m kept positions in the order that assigns them to runs (TRL's shuffle); `lengths[i]`: the tokens of
    kept row i (prompt + completion). Run s (`optimizer_segments`: positions [s·g, (s+1)·g)) trains on
    order[s·q : (s+1)·q], q = m·g/S, cut into n_s micro-batches that take the run's LAST n_s positions: the
    micro-step that ends an optimizer step (and syncs the gradients) is then always a real one; the first g − n_s
    positions are no-ops. Every rank has the same m, so the same positions are no-ops on every rank.

    `fill=True` (no-ops are free: one process, DDP): `pack_sorted`, n_s = ⌈q/capacity⌉, the fewest, fullest
    micro-batches. `fill=False` (a no-op still runs a forward: DeepSpeed, FSDP): `spread_sorted`, n_s = min(q, g),
    every position that would run anyway gets rows, sorted, so the forwards are the even layout's in number and in
    rows, each padded no wider (with q a multiple of g), and a no-op only where q < g.

    Raises ValueError when m is not a positive multiple of S/g or q > g·capacity (more rows than N)."""
    count, g = optimizer_segments(steps_per_generation, gradient_accumulation_steps)
    m = len(order)
    if m < count or m % count:
        raise ValueError(f"the packed layout needs a positive multiple of {count} kept rows, got {m}")
    q = m // count
    if q > g * capacity:
        raise ValueError(f"{q} kept rows do not fit {g} micro-batches of {capacity} rows")
    steps: list[list[int] | None] = []
    for s in range(count):
        rows = list(order[s * q : (s + 1) * q])
        run_lengths = [lengths[i] for i in rows]
        run_groups = None if groups is None else [groups[i] for i in rows]
        cut = pack_sorted(run_lengths, capacity, run_groups) if fill else spread_sorted(run_lengths, g, run_groups)
        batches = [[rows[i] for i in batch] for batch in cut]
        steps.extend([None] * (g - len(batches)) + batches)
    return steps


def row_mean_scale(rows: int, run_rows: int, run_length: int) -> float:
    """The factor on a packed micro-batch's loss for a loss type that is a mean over the micro-batch's rows (grpo,
    sapo, dr_grpo, luspo: `plan.LOSS_NORMALISERS`, `rows=True`):

        c = r · g / q     (r rows in this micro-batch; the run holds q rows over g micro-steps).

    TRL divides each micro-batch's row sum by its rows r and by G, so under the even layout (q/g rows per micro-step)
    each row weighs g / (G·q); a packed micro-batch times c gives each row (1/G)(1/r) · r·g/q = g/(G·q), the same.
    It multiplies the whole per-token loss (policy term through the advantages, KL term through β)."""
    return rows * run_length / run_rows


def token_mean_scale(tokens: float, run_tokens: float, run_length: int) -> float:
    """The factor on a packed micro-batch's KL term for bnpo (a mean over the micro-batch's own loss tokens T):

        c = T · g / T_run     (1 when T or T_run is 0: the term is then 0 anyway, and β must stay non-zero).

    Each kept token's KL then weighs g / (G·T_run): the run's token mean, as under the even layout when its
    micro-batches hold equal tokens (the even layout's KL depends on how the rows happen to split). The policy term
    needs nothing more: its factor T / (the full batch's mean micro-batch tokens) already makes it layout-free."""
    if tokens <= 0 or run_tokens <= 0:
        return 1.0
    return tokens * run_length / run_tokens


def micro_token_factor(tokens, micro_tokens_full: float):
    """bnpo's factor on a micro-batch's advantages (its loss divides by the micro-batch's own loss tokens T):

        T / T̄_full     (T̄_full: the full batch's mean micro-batch loss tokens; 1 when T = 0).

    It replaces the micro-batch's own divisor by the full batch's, so the kept rows' loss is the full batch's up to
    the weights. A micro-batch with no loss token adds no gradient whatever its factor; it keeps 1, as under
    GRPOTrainer (TRL clamps its divisor at 1). `tokens` a float or a device tensor (no device→host copy)."""
    if isinstance(tokens, torch.Tensor):
        return torch.where(tokens > 0, tokens / micro_tokens_full, torch.ones_like(tokens, dtype=torch.float))
    return tokens / micro_tokens_full if tokens > 0 else 1.0


def layout_for(args, aux_loss: bool = False) -> str:
    """The layout a `CostAwareGRPOConfig` runs: "packed", or "even" when a loss term is added per micro-batch, which
    fewer, fuller micro-batches would re-weight: TRL's entropy bonus (`entropy_coef != 0` or `use_adaptive_entropy`:
    a per-micro-batch token mean, with the adaptive controller's window) or a router aux loss (`aux_loss`, known
    once the model is loaded)."""
    entropy_bonus = getattr(args, "entropy_coef", 0.0) != 0.0 or bool(getattr(args, "use_adaptive_entropy", False))
    return "even" if entropy_bonus or aux_loss else "packed"


def sampling_floor_warning(
    layout: str,
    per_device_train_batch_size: int,
    steps_per_generation: int,
    gradient_accumulation_steps: int,
    kept_fraction: float | None,
) -> str | None:
    """A warning naming the fields when the shape keeps more than asked, or None.

    The kept count m is a multiple of k = `kept_multiple(...)` and at least k, of N = B·S rows per rank: a fixed
    fraction f keeps m/N = max(k, ⌊round(f·N)/k⌋·k)/N, which the warning reports when it exceeds 1.1·f; under a
    token budget (`kept_fraction` None) it warns when k = N (nothing can ever be dropped: the even layout at B = 1, or
    the packed layout at B = 1 with one optimizer step per micro-step)."""
    n = per_device_train_batch_size * steps_per_generation
    k = kept_multiple(layout, steps_per_generation, gradient_accumulation_steps)
    shape = (
        f"per_device_train_batch_size={per_device_train_batch_size}, steps_per_generation={steps_per_generation}, "
        f"gradient_accumulation_steps={gradient_accumulation_steps} (the {layout} layout)"
    )
    why = (
        f"the kept row count is a multiple of {k} ("
        + (
            "every micro-step gets the same number of rows"
            if layout == "even"
            else "every optimizer step of the generation batch gets the same number of rows"
        )
        + f") out of {n} rows per rank"
    )
    if kept_fraction is not None:
        m = kept_row_count(n, float(kept_fraction), k)
        if m / n > 1.1 * kept_fraction:
            return (
                f"cost_aware_kept_fraction={kept_fraction} keeps {m}/{n} = {m / n:.2f} of each generation batch with "
                f"{shape}: {why}."
            )
        return None
    if k >= n:
        return f"Cost-aware sampling can drop no row with {shape}: {why}."
    return None
