"""How the kept rows of a generation batch are laid out into micro-batches (pure arithmetic, no trainer).

TRL splits each rank's generation batch of N = B · S rows (B = `per_device_train_batch_size`, S =
`steps_per_generation`) into S micro-batches of B rows. Cost-aware sampling keeps m = f · N of them, so by default
each micro-batch holds f · B rows and there are as many micro-batches as before. On an accelerator a micro-batch of few
rows costs nearly as much as a full one (kernel launches, the per-step weight-gradient work, which scales with the
parameter count rather than the tokens), so the update time falls much less than the tokens.

The full layout keeps the generation batch and the sample, and changes only how they are cut:

    B' = B / f,    S' = f · S,    G' = f · G      (G = `gradient_accumulation_steps`)

so the generation batch is B' · S' = B · S rows as before, the m = f · B · S kept rows fill S' micro-batches of
f · B' = B rows each, and each optimizer step takes G' micro-steps instead of G (one generation batch per optimizer
step stays one). B, S and G must make B', S' and G' whole numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int | None


def _whole(value: float, what: str) -> int:
    rounded = round(value)
    if rounded < 1 or abs(rounded - value) > 1e-9:
        raise ValueError(what)
    return rounded


def full_micro_batch_layout(
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    steps_per_generation: int | None,
    kept_fraction: float,
) -> Layout:
    """B' = B/f, G' = f·G, S' = f·S (S None: TRL's default S = G, which then stays None so TRL derives S' = G').

    Raises ValueError naming the fields when a result is not a whole number of rows or steps."""
    f = kept_fraction
    hint = (
        f"cost_aware_full_micro_batches=True with cost_aware_kept_fraction={f} needs per_device_train_batch_size / "
        f"{f}, gradient_accumulation_steps × {f} and steps_per_generation × {f} to be whole numbers; got "
        f"per_device_train_batch_size={per_device_train_batch_size}, gradient_accumulation_steps="
        f"{gradient_accumulation_steps}, steps_per_generation={steps_per_generation}"
    )
    rows = _whole(per_device_train_batch_size / f, hint)
    accumulation = _whole(gradient_accumulation_steps * f, hint)
    spg = None if steps_per_generation is None else _whole(steps_per_generation * f, hint)
    return Layout(rows, accumulation, spg)
