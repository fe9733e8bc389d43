"""A chat task for a small real model (`smollm2.py`): times tables, rewarded by an exact parse of the final number.

    prompt   [{"role": "user", "content": "What is 7 times 8? End your reply with the final number."}]
    answer   "56"

a is uniform on 2..9 and b on 2..12 (88 problems). The completion is rewarded 1.0 when its final number, the last
number in the text followed by nothing but punctuation, spaces or markdown (``"... is 56."``, ``"**56**"``), equals
a·b; 0.0 otherwise, including a reply that ends in words (the prompt asks for the number last) or is cut off by the
length cap. A small instruct model sampled at temperature 1 solves some but not all rollouts of most of these
problems, with replies from a bare number to a worked paragraph: rows of one group differ in outcome and in cost.
"""

from __future__ import annotations

import random
import re
from typing import Any

PROMPT = "What is {a} times {b}? End your reply with the final number."
A_RANGE = (2, 9)
B_RANGE = (2, 12)
# A number (digits, optional thousands commas, optional decimals) followed only by non-alphanumerics to the end.
_FINAL_NUMBER_RE = re.compile(r"(-?\d[\d,]*(?:\.\d+)?)[^0-9A-Za-z]*$")


def make_problem(a: int, b: int, conversational: bool = True) -> dict[str, Any]:
    """One problem: ``prompt`` (a one-message chat, or the plain string), ``answer`` (str of a·b), ``solution`` (a
    correct reply), ``a`` and ``b``."""
    text = PROMPT.format(a=a, b=b)
    return {
        "prompt": [{"role": "user", "content": text}] if conversational else text,
        "answer": str(a * b),
        "solution": f"{a} times {b} is {a * b}.",
        "a": a,
        "b": b,
    }


def times_table_dataset(
    n: int,
    *,
    seed: int = 0,
    a_range: tuple[int, int] = A_RANGE,
    b_range: tuple[int, int] = B_RANGE,
    conversational: bool = True,
):
    """`n` problems, a uniform on `a_range` and b on `b_range` (inclusive), drawn independently with `random.Random(
    seed)`; a `datasets.Dataset` with columns ``prompt``, ``answer``, ``solution``, ``a``, ``b`` (`make_problem`).
    Deterministic given `seed`."""
    from datasets import Dataset

    (a_lo, a_hi), (b_lo, b_hi) = a_range, b_range
    if not (a_lo <= a_hi and b_lo <= b_hi):
        raise ValueError(f"empty range: a in {a_range}, b in {b_range}")
    rng = random.Random(seed)
    rows = [make_problem(rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi), conversational) for _ in range(n)]
    if not rows:
        return Dataset.from_dict({"prompt": [], "answer": [], "solution": [], "a": [], "b": []})
    return Dataset.from_list(rows)


def completion_text(completion) -> str:
    """A completion as TRL passes it: a string, or a list of messages (conversational: the last message's
    ``content``)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return completion_text(completion[-1]) if completion else ""
    return str(completion)


def final_number(completion) -> float | None:
    """The completion's final number (`_FINAL_NUMBER_RE`: the last number, followed only by non-alphanumerics up
    to the end of the text), thousands commas removed; None when the text does not end with a number."""
    match = _FINAL_NUMBER_RE.search(completion_text(completion).strip())
    if match is None:
        return None
    try:
        return float(match.group(1).replace(",", ""))
    except ValueError:  # e.g. "1,,": not a number
        return None


def times_table_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when `final_number` of the completion equals the answer exactly, else 0.0."""
    out = []
    for completion, a in zip(completions, answer, strict=True):
        value = final_number(completion)
        out.append(1.0 if value is not None and value == float(a) else 0.0)
    return out
