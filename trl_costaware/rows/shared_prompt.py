"""The shared-prompt layout: the rows of a micro-batch that repeat one prompt, run with that prompt once (pure tensor
code; docs/layout.md, "Shared prompts").

TRL's log-prob pass feeds B rows [prompt (left-padded, P columns) | completion (right-padded, W columns)] and scores
the completion tokens. Rows whose prompt columns are identical form a group g = {r_1, ..., r_k}. The group becomes
one sequence

    [ prompt tokens but the last | p_last, y_1,1 .. y_1,n1 | p_last, y_2,1 .. y_2,n2 | ... ]
       shared prefix               segment of r_1            segment of r_2

where each segment repeats the prompt's last token (its hidden state predicts the completion's first token, one
label per position) and holds the row's real completion tokens. Each token keeps the position id of its column in
the unshared row (its column index, which is what the unshared forward uses), and attends to

    allowed[q, k] = k ≤ q  and  (k in the prefix  or  k in q's segment)

so every query sees exactly the keys it sees in its own unshared row: the same function of the same inputs, hence the
same log-probs and gradients up to floating-point summation order. A sequence of a group is
P_real − 1 + Σ_i (1 + n_i) tokens long instead of Σ_i (P_real + n_i); the token ratio of a micro-batch is

    shared / unshared = Σ_g (P_g + Σ_{i in g} (1 + n_i) − 1) / Σ_rows (P_r + n_r).

The layout needs completions that are a prefix of their columns (mask 1…1 0…0) and a real last prompt column in every
row (left-padded prompts), or it does not apply (`SharedLayout.reason`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from .batching import concat_rows, select_rows

IGNORE = -100


@dataclass(frozen=True)
class SharedLayout:
    """The sequences of `shared_layout` (one per group, padded to the longest), on the input's device:

    - `input_ids`, `position_ids`, `shift_labels` (n, L): the token at each position, its unshared column, the token
      it predicts (`IGNORE` where none: the prefix, a segment's last token, padding);
    - `allowed` (n, L, L) bool: query attends key (padding attends to itself only, so no softmax row is empty);
    - `targets` (K,): for the positions with a label, in row-major order, their flat index r · W + j into the
      unshared (B, W) per-token output;
    - `tokens` / `unshared_tokens`: real tokens run shared / in the unshared rows (prompt + completion mask)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    allowed: torch.Tensor
    targets: torch.Tensor
    rows: int
    width: int
    tokens: int
    unshared_tokens: int


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> list[list[int]]:
    """The rows of the batch grouped by identical prompt columns (ids where the mask is 1, and the mask), groups in
    order of their first row, rows in batch order."""
    prompt_len = input_ids.size(1) - logits_to_keep
    mask = attention_mask[:, :prompt_len].bool().cpu()
    ids = input_ids[:, :prompt_len].cpu().masked_fill(~mask, -1)
    groups: dict[bytes, list[int]] = {}
    for row, key in enumerate(ids.numpy()):
        groups.setdefault(key.tobytes(), []).append(row)
    return list(groups.values())


def group_ids(batch: dict) -> list[int]:
    """A prompt group id per row of `batch` (the index of its group in `prompt_groups` of the prompt columns)."""
    ids = [0] * len(batch["prompt_ids"])
    for g, rows in enumerate(prompt_groups(batch["prompt_ids"], batch["prompt_mask"], 0)):
        for row in rows:
            ids[row] = g
    return ids


def layout_problem(attention_mask: torch.Tensor, logits_to_keep: int) -> str | None:
    """Why the shared layout cannot reproduce the unshared pass on this batch, or None: it needs a prompt column, a
    real last prompt column in every row (left padding) and completions whose mask is a prefix of their columns."""
    prompt_len = attention_mask.size(1) - logits_to_keep
    if prompt_len < 1 or logits_to_keep < 1:
        return "the batch has no prompt or no completion columns"
    mask = attention_mask.bool().cpu()
    if not mask[:, prompt_len - 1].all():
        return "a row's last prompt column is padding (prompts are not left-padded)"
    completion = mask[:, prompt_len:]
    lengths = completion.sum(-1, keepdim=True)
    if not torch.equal(completion, torch.arange(logits_to_keep) < lengths):
        return "a completion mask has a hole (a 0 before a 1)"
    return None


def shared_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, groups: list[list[int]]
) -> SharedLayout:
    """The shared-prompt sequences of `groups` (lists of row indices; `prompt_groups`) of a batch for which
    `layout_problem` is None. Rows outside `groups` get no target (their outputs stay 0). The layout is built on the
    host from `attention_mask` (pass a host copy to avoid a transfer) and moved to `input_ids`' device."""
    rows, total = input_ids.shape
    prompt_len = total - logits_to_keep
    mask = attention_mask.bool().cpu()
    lengths = mask[:, prompt_len:].sum(-1)
    src_rows, src_cols, seg_ids, labelled = [], [], [], []  # per sequence, per position
    for group in groups:
        prefix = mask[group[0], : prompt_len - 1].nonzero().squeeze(1)  # the prompt's real columns but the last
        members = torch.tensor(group)
        span = lengths[members] + 1  # a segment: the prompt's last token, then the completion
        offset = torch.arange(int(span.sum())) - (span.cumsum(0) - span).repeat_interleave(span)
        src_rows.append(torch.cat([torch.full_like(prefix, group[0]), members.repeat_interleave(span)]))
        src_cols.append(torch.cat([prefix, prompt_len - 1 + offset]))
        seg_ids.append(torch.cat([torch.zeros_like(prefix), torch.arange(1, len(group) + 1).repeat_interleave(span)]))
        labelled.append(torch.cat([torch.zeros_like(prefix), offset < (span - 1).repeat_interleave(span)]).bool())
    src_rows, src_cols, labelled = (pad_sequence(x, batch_first=True) for x in (src_rows, src_cols, labelled))
    seg_ids = pad_sequence(seg_ids, batch_first=True, padding_value=-1)
    width = seg_ids.size(1)
    real = seg_ids >= 0
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = (seg_ids[:, None, :] == 0) | (seg_ids[:, None, :] == seg_ids[:, :, None])
    allowed = causal & same & real[:, :, None] & real[:, None, :]
    allowed |= torch.eye(width, dtype=torch.bool) & ~real[:, :, None]  # padding attends to itself
    device = input_ids.device
    label_cols = (src_cols + 1).clamp(max=total - 1)  # a label is the row's next column
    ids = input_ids[src_rows.to(device), src_cols.to(device)].masked_fill(~real.to(device), 0)
    labels = input_ids[src_rows.to(device), label_cols.to(device)].masked_fill(~labelled.to(device), IGNORE)
    return SharedLayout(
        input_ids=ids,
        position_ids=src_cols.masked_fill(~real, 0).to(device),
        shift_labels=labels,
        allowed=allowed.to(device),
        targets=(src_rows * logits_to_keep + label_cols - prompt_len)[labelled].to(device),
        rows=rows,
        width=logits_to_keep,
        tokens=int(real.sum()),
        unshared_tokens=int(mask[[r for g in groups for r in g]].sum()),
    )


@dataclass(frozen=True)
class SharedPass:
    """One batch's shared pass, planned on the host once (`plan_pass`): a host copy of its attention `mask`, the
    prompt `groups` it shares (`prompt_groups`; empty where it runs unshared) and why it runs unshared (`reason`:
    `layout_problem`'s, None where the layout applies)."""

    mask: torch.Tensor
    logits_to_keep: int
    groups: list[list[int]]
    reason: str | None

    @property
    def shared(self) -> bool:
        """Whether it runs shared: the layout applies and some prompt repeats (else unshared is the same work)."""
        return 0 < len(self.groups) < len(self.mask)

    def tokens(self) -> tuple[int, int]:
        """(real tokens, padded tokens) of the shared pass run as one forward (TRL's policy pass):
        Σ_g (P_g − 1 + Σ_{i in g} (1 + n_i)), and the groups times the longest sequence."""
        prompt_len = self.mask.size(1) - self.logits_to_keep
        prompt, completion = self.mask[:, :prompt_len].sum(-1), self.mask[:, prompt_len:].sum(-1)
        lengths = [int(prompt[g[0]]) - 1 + sum(1 + int(completion[r]) for r in g) for g in self.groups]
        return sum(lengths), len(self.groups) * max(lengths)


def plan_pass(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> SharedPass:
    """The `SharedPass` of a batch: one device→host copy of its ids and mask, then host work."""
    host_ids, host_mask = torch.stack([input_ids, attention_mask.to(input_ids.dtype)]).cpu()
    reason = layout_problem(host_mask, logits_to_keep)
    groups = [] if reason is not None else prompt_groups(host_ids, host_mask, logits_to_keep)
    return SharedPass(host_mask, logits_to_keep, groups, reason)


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The 4D mask the model takes, (n, 1, L, L): `allowed` itself for SDPA (`dtype` None), else additive (0 where
    allowed, the dtype's minimum elsewhere) for an implementation that adds the mask to its scores (eager)."""
    mask = allowed[:, None]
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def unshare(per_position: torch.Tensor, layout: SharedLayout) -> torch.Tensor:
    """A per-position output of the shared sequences (n, L; e.g. the fused head's log-probs) as the unshared pass's
    per-token output (B, W): each label position's value at its row and completion column, 0 elsewhere.
    Differentiable in `per_position`."""
    values = per_position[layout.shift_labels != IGNORE]
    flat = values.new_zeros(layout.rows * layout.width).index_copy(0, layout.targets, values)
    return flat.view(layout.rows, layout.width)


def shared_forward(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    groups: list[list[int]],
    *,
    bias_dtype: torch.dtype | None,
    compute_entropy: bool = False,
    batch_size: int | None = None,
    autocast=nullcontext,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """The per-token log-probs (B, W) (and entropies) of the unshared pass, computed with each group's prompt once:
    `model` carries TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`, which scores pre-shifted
    `shift_labels`); forwards of at most `batch_size` rows, as TRL chunks its rows (a larger group is split into
    sequences of at most `batch_size` rows, each with the prompt); `bias_dtype` as in `attention_bias`; each forward
    inside `autocast()`. Returns (log-probs, entropies or None, tokens run, tokens the unshared rows hold)."""
    limit = batch_size or len(input_ids)
    pieces = [group[i : i + limit] for group in groups for i in range(0, len(group), limit)]
    chunks, rows = [[]], 0
    for group in pieces:
        if chunks[-1] and rows + len(group) > limit:
            chunks.append([])
            rows = 0
        chunks[-1].append(group)
        rows += len(group)
    logps = entropies = None
    tokens = unshared_tokens = 0
    for chunk in chunks:
        layout = shared_layout(input_ids, attention_mask, logits_to_keep, chunk)
        with autocast():
            out = model(
                input_ids=layout.input_ids,
                attention_mask=attention_bias(layout.allowed, bias_dtype),
                position_ids=layout.position_ids,
                shift_labels=layout.shift_labels,
                fused_lm_head=True,
            )
        part = unshare(out.log_probs, layout)
        logps = part if logps is None else logps + part
        if compute_entropy:
            part = unshare(out.entropy, layout)
            entropies = part if entropies is None else entropies + part
        tokens, unshared_tokens = tokens + layout.tokens, unshared_tokens + layout.unshared_tokens
    return logps, entropies, tokens, unshared_tokens


SHARED_ATTENTION = ("sdpa", "eager")  # implementations that take a custom 4D mask as given
# Loss types whose optimizer-step gradient does not depend on which of its equal-sized micro-batches a row is in: a
# mean over rows, or a sum over a batch-wide token count (bnpo divides by the micro-batch's own tokens).
REGROUPABLE_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo", "dapo", "cispo", "vespo")


def sliding_window_in_use(config) -> bool:
    """Whether the model attends within a window (the custom mask would not apply it): a layer of type
    "sliding_attention", or a `sliding_window` size that `use_sliding_window` does not switch off."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def refusal(config, multimodal: bool, aux_loss: bool, prompt_learning: bool) -> str | None:
    """Why `shared_prompt_forward=True` cannot be exact for this model and setting, or None."""
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SHARED_ATTENTION:
        return f"the attention implementation is {attention!r}, not one of {SHARED_ATTENTION} (a custom 4D mask)"
    if sliding_window_in_use(config):
        return "the model uses sliding-window attention, which a custom 4D mask does not apply"
    if multimodal:
        return "the model is multimodal (its image inputs are per row)"
    if aux_loss:
        return "the router aux loss averages over every token of every row"
    if prompt_learning:
        return "a PEFT prompt-learning adapter prepends virtual tokens to each row"
    return None


def group_micro_batches(chunks: list[dict], run_length: int) -> list[dict]:
    """TRL's micro-batches with each run of `run_length` consecutive ones (an optimizer step's share of the buffer)
    re-split into the same sizes with the rows of each prompt together (`prompt_groups` over the run, groups in order
    of first appearance). Every per-row entry moves with its row (`batching.select_rows`); widths are the buffer's."""
    out = []
    for start in range(0, len(chunks), run_length):
        run = chunks[start : start + run_length]
        sizes = [len(c["prompt_ids"]) for c in run]
        merged = concat_rows(run)
        groups = prompt_groups(merged["prompt_ids"], merged["prompt_mask"], 0)
        merged = select_rows(merged, torch.tensor([r for g in groups for r in g]))
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        out += [select_rows(merged, torch.arange(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    return out
