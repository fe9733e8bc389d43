"""The micro-batches of one generation batch, in either layout, as plain functions with explicit inputs
(docs/layout.md).

`layout.packed_micro_steps` says which kept rows each micro-step position trains on; `pack_buffer` builds those
micro-batches (trimmed, with the loss type's correction, each with its `MicroStep`) and places the no-op micro-steps;
`even_buffer` trims and corrects TRL's own even split instead; `token_weighted_means`
turns TRL's per-micro-batch metric means into means over the window's tokens. The trainer calls them and runs the
loss of each micro-step (a no-op adds no gradient and no metric, and skips the model where that is safe:
`noop_skippable`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batching import loss_mask, select_rows, trim_to_longest
from .layout import micro_token_factor, optimizer_segments, packed_micro_steps, row_mean_scale, token_mean_scale
from .plan import check_loss_type


@dataclass(frozen=True)
class MicroStep:
    """What the trainer needs of one micro-step beyond TRL's batch: `noop` (it trains nothing), its β multiplier
    (`layout.row_mean_scale`, `layout.token_mean_scale`; 1 outside the packed layout), this rank's (loss tokens, rows)
    of a packed micro-batch, the weights of its metrics (`token_weighted_means`; else None), and its real (prompt +
    completion) tokens when the layout knows them on the host (`policy_tokens`; else None)."""

    noop: bool = False
    beta_scale: float = 1.0
    metric_weights: tuple[float, float] | None = None
    policy_tokens: float | None = None


NOOP = MicroStep(noop=True)
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


def noop_skippable(accelerator) -> bool:
    """Whether a no-op micro-step that does not sync gradients may skip the model: `DATA_PARALLEL_TYPES`, and not
    accelerate's `sync_each_batch`. Where it may, runs are packed into the fewest, fullest micro-batches; elsewhere
    (a no-op would run a forward anyway) spread over all their micro-step positions, sorted."""
    if accelerator.distributed_type.name not in DATA_PARALLEL_TYPES:
        return False
    return accelerator.num_processes == 1 or not accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)


def pack_buffer(
    kept_batch: dict,
    order: list[int],
    lengths: list[float],
    loss_tokens: list[float],
    *,
    loss_type: str,
    steps_per_generation: int,
    gradient_accumulation_steps: int,
    capacity: int,
    fill: bool,
    noop: dict,
    pad_to_multiple_of: int | None = None,
    widths: tuple[list[float], list[float]] | None = None,
    micro_tokens_full: float | None = None,
    groups: list[int] | None = None,
) -> list[tuple[dict, MicroStep]]:
    """The packed layout of one generation batch: its S micro-step entries, each (`noop`, `NOOP`) or a real
    micro-batch with its `MicroStep` (β multiplier, and its loss tokens and rows).

    `kept_batch` holds the m kept rows; `order` their positions in the order that assigns them to runs (TRL's shuffle);
    `lengths[i]` / `loss_tokens[i]` kept row i's tokens (prompt + completion) and loss tokens; `widths` (prompt,
    completion) tokens per kept row, to trim each micro-batch without reading the device; `groups` a prompt group id
    per kept row, to keep a group's rows together (`layout.packed_micro_steps`). Corrections, per
    micro-batch of r rows in a run of q rows, g micro-steps and T_run loss tokens: a mean over rows (grpo, sapo,
    dr_grpo, luspo) r·g/q on the advantages and on β; bnpo the even layout's factor T/T̄_full on the advantages
    (`micro_tokens_full`) and T·g/T_run on β; a batch-token loss (dapo, cispo, vespo) nothing."""
    m = len(order)
    steps = packed_micro_steps(
        order, lengths, steps_per_generation, gradient_accumulation_steps, capacity, fill, groups
    )
    count, g = optimizer_segments(steps_per_generation, gradient_accumulation_steps)
    q = m // count
    run_tokens = [sum(loss_tokens[i] for i in order[s * q : (s + 1) * q]) for s in range(count)]
    normaliser = check_loss_type(loss_type)
    out = []
    for position, rows in enumerate(steps):
        if rows is None:
            out.append((noop, NOOP))
            continue
        index = torch.tensor(rows)
        width = None if widths is None else (max(widths[0][i] for i in rows), max(widths[1][i] for i in rows))
        chunk = trim_to_longest(select_rows(kept_batch, index), pad_to_multiple_of, width)
        chunk.pop("cost_aware_rows", None)
        tokens = float(sum(loss_tokens[i] for i in rows))
        beta_scale = 1.0
        if normaliser.rows:
            beta_scale = row_mean_scale(len(rows), q, g)
            chunk["advantages"] = chunk["advantages"] * beta_scale
        elif normaliser.micro_tokens:
            beta_scale = token_mean_scale(tokens, run_tokens[position // g], g)
            if micro_tokens_full is not None:
                chunk["advantages"] = chunk["advantages"] * micro_token_factor(tokens, micro_tokens_full)
        step = MicroStep(
            beta_scale=beta_scale,
            metric_weights=(tokens, float(len(rows))),
            policy_tokens=float(sum(lengths[i] for i in rows)),
        )
        out.append((chunk, step))
    return out


def even_buffer(
    chunks: list[dict],
    host: dict | None,
    *,
    pad_to_multiple_of: int | None = None,
    micro_tokens_full: float | None = None,
) -> list[tuple[dict, MicroStep]]:
    """The even layout of one generation batch: TRL's own split `chunks` (each holding its rows' kept positions,
    ``cost_aware_rows``), each micro-batch trimmed to its longest row, with bnpo's factor T_k / T̄_full on its
    advantages (`layout.micro_token_factor`: the micro-batch's loss tokens T_k over the full batch's mean per
    micro-batch `micro_tokens_full`, when given). `host` holds the kept rows' statistics (``prompt_tokens``,
    ``completion_tokens``, ``loss_tokens``, by kept position), so widths, token counts and each `MicroStep`'s
    `policy_tokens` come without reading the device; without it (a subclass's own draw) they are read from the masks.
    """
    positions = [c.get("cost_aware_rows") for c in chunks]
    known = host is not None and all(p is not None for p in positions)
    out = []
    for chunk, rows in zip(chunks, positions, strict=True):
        width = tokens = None
        if known:
            prompt, completion = host["prompt_tokens"][rows], host["completion_tokens"][rows]
            width = (float(prompt.max()), float(completion.max())) if len(rows) else (0.0, 0.0)
            tokens = float(prompt.sum() + completion.sum())
        chunk = trim_to_longest(chunk, pad_to_multiple_of, width)
        if micro_tokens_full is not None:
            loss_tokens = float(host["loss_tokens"][rows].sum()) if known else loss_mask(chunk).sum()
            chunk["advantages"] = chunk["advantages"] * micro_token_factor(loss_tokens, micro_tokens_full)
        chunk.pop("cost_aware_rows", None)
        out.append((chunk, MicroStep(policy_tokens=tokens)))
    return out


def token_weighted_means(metrics: dict, tokens: list[float], rows: list[float], per_row_level: bool) -> None:
    """TRL's per-micro-batch means (`PER_TOKEN_METRICS`, `PER_ROW_METRICS`, `PER_LEVEL_METRICS`) of one logging window,
    in `metrics`, replaced in place by their mean over the window's loss tokens (rows for a per-sequence value):

        value = Σ_k C_k v_k / Σ_k C_k     (v_k: micro-batch k's value, C_k its global token or row count),

    the mean over the step's tokens that TRL's unweighted mean over micro-batches is when they hold equal tokens (as
    GRPOTrainer's B-row micro-batches do in expectation); packed micro-batches are fewer and unequal. A metric whose
    entries do not pair one to one with the window's micro-batches is left as TRL averages it."""
    for key in PER_TOKEN_METRICS + PER_ROW_METRICS + PER_LEVEL_METRICS:
        values = metrics.get(key)
        if not values or len(values) != len(tokens):
            continue
        by_row = key in PER_ROW_METRICS or (key in PER_LEVEL_METRICS and per_row_level)
        counts = rows if by_row else tokens
        total = sum(counts)
        if total > 0:
            metrics[key] = [sum(c * float(v) for c, v in zip(counts, values, strict=True)) / total]
