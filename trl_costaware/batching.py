"""Row selection, padding trimming and length grouping on TRL's batch dicts (plain tensor code, no trainer).

A TRL GRPO batch is a dict of per-row tensors (first dimension = rows), 0-dim tensors (e.g. `num_items_in_batch`)
and possibly lists. Prompts are left-padded (`prompt_ids`, `prompt_mask`) and completions right-padded
(`completion_ids`, `completion_mask` and every per-completion-token tensor such as `old_per_token_logps`).
"""

from __future__ import annotations

import torch

PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def num_rows(batch: dict) -> int:
    return len(batch["completion_ids"])


def select_rows(batch: dict, indices: torch.Tensor) -> dict:
    """Take rows `indices` (repeats allowed) of every per-row entry; 0-dim tensors and None pass through."""
    n = num_rows(batch)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == n:
            out[key] = value[indices.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in indices.tolist()]
        else:
            out[key] = value
    return out


def _round_up(width: int, multiple_of: int | None, limit: int) -> int:
    if not multiple_of:
        return width
    return min(limit, -(-width // multiple_of) * multiple_of)


def trim_to_longest(batch: dict, multiple_of: int | None = None) -> dict:
    """Drop padding columns that no row of this batch uses: leading prompt columns (left padding) and trailing
    completion columns (right padding), in every tensor that spans them. The width becomes the longest row's, rounded
    up to a multiple of `multiple_of` (TRL's `pad_to_multiple_of`) when set, never beyond the current width."""
    prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_mask"]
    p_width, c_width = prompt_mask.shape[1], completion_mask.shape[1]
    p_keep = int(prompt_mask.sum(-1).max()) if len(prompt_mask) else 0
    used = completion_mask.bool().any(0).nonzero()
    c_keep = int(used.max()) + 1 if len(used) else 1  # keep one column so every tensor stays 2-D and non-empty
    p_keep, c_keep = _round_up(p_keep, multiple_of, p_width), _round_up(c_keep, multiple_of, c_width)
    if p_keep == p_width and c_keep == c_width:
        return batch
    out = {}
    for key, value in batch.items():
        if key in PROMPT_KEYS:
            out[key] = value[:, p_width - p_keep :]
        elif isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == c_width:
            out[key] = value[:, :c_keep]
        else:
            out[key] = value
    return out


def row_lengths(batch: dict) -> torch.Tensor:
    """Real (non-padding) tokens per row: prompt + completion."""
    return batch["prompt_mask"].sum(-1) + batch["completion_mask"].sum(-1)


def concat_batches(batches: list[dict]) -> dict:
    """Inverse of TRL's `split_tensor_dict` for equal-width chunks: concatenate per-row entries."""
    out = {}
    for key, value in batches[0].items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            out[key] = torch.cat([b[key] for b in batches])
        elif isinstance(value, list):
            out[key] = [x for b in batches for x in b[key]]
        else:
            out[key] = value
    return out


def regroup_by_length(batches: list[dict], generator: torch.Generator | None = None) -> list[dict]:
    """Re-split equal-size chunks so each holds rows of similar length (sorted by prompt + completion tokens), then
    shuffle the chunk order. Every chunk keeps the same number of rows, which multi-process training needs."""
    k = len(batches)
    merged = concat_batches(batches)
    order = torch.argsort(row_lengths(merged), stable=True)
    size = len(order) // k
    chunks = [select_rows(merged, order[i * size : (i + 1) * size]) for i in range(k)]
    perm = torch.randperm(k, generator=generator).tolist()
    return [chunks[i] for i in perm]
