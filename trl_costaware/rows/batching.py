"""Row selection, padding trimming and length grouping on TRL's batch dicts (plain tensor code, no trainer).

A TRL GRPO batch is a dict of per-row tensors (first dimension = rows), 0-dim tensors (e.g. `num_items_in_batch`)
and possibly lists. Prompts are left-padded (`prompt_ids`, `prompt_mask`) and completions right-padded
(`completion_ids`, `completion_mask` and every per-completion-token tensor such as `old_per_token_logps`).
"""

from __future__ import annotations

import torch

# Every key a text-only TRL 1.16 GRPO training batch (plus this package's own) may hold, by layout. A key in none of
# these lists is refused (`check_keys`): deciding per-row or per-token by shape alone would pass a new per-row entry of
# another shape through misaligned.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # (N, P), left-padded
COMPLETION_KEYS = (  # (N, C), right-padded like completion_ids; trimmed with it
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",  # (N, C) for token-level modes; (N, 1) for sequence-level ones (never trimmed)
)
ROW_KEYS = ("advantages", "cost_aware_rows")  # (N,) tensors, or lists of N items
SCALAR_KEYS = ("num_items_in_batch",)  # 0-dim tensors, the same for every row: passed through
KNOWN_KEYS = PROMPT_KEYS + COMPLETION_KEYS + ROW_KEYS + SCALAR_KEYS


def check_keys(batch: dict) -> None:
    """Refuse a batch key this module does not know the layout of (a multimodal or future TRL entry), naming it."""
    unknown = [key for key in batch if key not in KNOWN_KEYS]
    if unknown:
        raise ValueError(
            f"CostAwareGRPOTrainer cannot select rows of the batch keys {unknown}: their layout (per row, per "
            f"completion token, per prompt token or per batch) is unknown. Known keys: prompt {PROMPT_KEYS}, "
            f"completion {COMPLETION_KEYS}, row {ROW_KEYS}, scalar {SCALAR_KEYS}. Set cost_aware=False to train this "
            "batch with plain GRPO, or add the key to trl_costaware/rows/batching.py."
        )


def _take(value, indices: torch.Tensor, host_indices: list[int] | None):
    if value is None:
        return None
    if isinstance(value, list):
        return [value[i] for i in (host_indices if host_indices is not None else indices.tolist())]
    return value[indices.to(value.device)]


def select_rows(batch: dict, indices: torch.Tensor) -> dict:
    """Take rows `indices` (repeats allowed) of every per-row entry (`PROMPT_KEYS`, `COMPLETION_KEYS`, `ROW_KEYS`);
    `SCALAR_KEYS` pass through; any other key raises (`check_keys`). Host `indices` index device tensors directly
    (no transfer) and lists without a transfer."""
    check_keys(batch)
    host = indices.tolist() if indices.device.type == "cpu" else None
    return {key: value if key in SCALAR_KEYS else _take(value, indices, host) for key, value in batch.items()}


def concat_rows(batches: list[dict]) -> dict:
    """The rows of `batches` (dicts of the same keys and widths, e.g. TRL's micro-batches of one buffer) in one dict,
    in order: per-row tensors and lists concatenated, `SCALAR_KEYS` taken from the first; any other key raises."""
    for batch in batches:
        check_keys(batch)
    out = {}
    for key, value in batches[0].items():
        if key in SCALAR_KEYS or value is None:
            out[key] = value
        elif isinstance(value, list):
            out[key] = [item for batch in batches for item in batch[key]]
        else:
            out[key] = torch.cat([batch[key] for batch in batches])
    return out


def _round_up(width: int, multiple_of: int | None, limit: int) -> int:
    if not multiple_of:
        return width
    return min(limit, -(-width // multiple_of) * multiple_of)


def trim_to_longest(batch: dict, multiple_of: int | None = None, widths: tuple[int, int] | None = None) -> dict:
    """Drop padding columns that no row of this batch uses: leading prompt columns (left padding) and trailing
    completion columns (right padding), in every `PROMPT_KEYS` / `COMPLETION_KEYS` tensor. The width becomes the
    longest row's, rounded up to a multiple of `multiple_of` (TRL's `pad_to_multiple_of`) when set, never beyond the
    current width. `widths` = (longest prompt, longest completion) in tokens, when the caller knows them on the host
    (no device→host transfer); otherwise they are read from the masks (two transfers)."""
    check_keys(batch)
    prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_mask"]
    p_width, c_width = prompt_mask.shape[1], completion_mask.shape[1]
    if widths is None:
        p_keep = int(prompt_mask.sum(-1).max()) if len(prompt_mask) else 0
        c_keep = int(completion_mask.sum(-1).max()) if len(completion_mask) else 0  # right-padded: length = width
    else:
        p_keep, c_keep = (int(w) for w in widths)
    c_keep = max(c_keep, 1)  # keep one column so every tensor stays 2-D and non-empty
    p_keep, c_keep = _round_up(p_keep, multiple_of, p_width), _round_up(c_keep, multiple_of, c_width)
    if p_keep == p_width and c_keep == c_width:
        return batch
    out = {}
    for key, value in batch.items():
        if key in PROMPT_KEYS:
            out[key] = value[:, p_width - p_keep :]
        elif key in COMPLETION_KEYS and value is not None and value.shape[1] == c_width:
            out[key] = value[:, :c_keep]
        else:
            out[key] = value
    return out


def row_lengths(batch: dict) -> torch.Tensor:
    """Real (non-padding) tokens per row: prompt + completion."""
    return batch["prompt_mask"].sum(-1) + batch["completion_mask"].sum(-1)


def full_sequences(batch: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input ids, attention mask, logits_to_keep) of a batch's log-prob pass: its prompt and completion columns
    side by side, as TRL's passes feed them."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    return ids, torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1), batch["completion_ids"].size(1)


def loss_mask(batch: dict) -> torch.Tensor:
    """The completion tokens the loss counts: the completion mask, times the tool mask when there is one."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if batch.get("tool_mask") is not None else mask


def noop_micro_batch(batch: dict) -> dict:
    """A micro-batch that trains on nothing: one row of one prompt token (row 0's last, attended) and one completion
    token (row 0's first) with completion mask 0 (tool mask 0), advantage 0; `SCALAR_KEYS` pass through. Every loss
    type masks its per-token loss with the completion mask (and clamps its divisors at 1), so its forward/backward
    adds exactly zero gradient while a backend still sees a micro-step. The attended prompt token keeps every
    attention row non-empty (an all-masked row would give NaN, and NaN · 0 is not 0)."""
    check_keys(batch)
    prompt_ids = batch["prompt_ids"][:1, -1:]
    completion_ids = batch["completion_ids"][:1, :1]
    out = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(batch["prompt_mask"][:1, -1:]),
        "completion_ids": completion_ids,
        "completion_mask": torch.zeros_like(batch["completion_mask"][:1, :1]),
        "advantages": torch.zeros_like(batch["advantages"][:1]),
    }
    if batch.get("tool_mask") is not None:
        out["tool_mask"] = torch.zeros_like(batch["tool_mask"][:1, :1])
    out.update({key: batch[key] for key in SCALAR_KEYS if key in batch})
    return out
