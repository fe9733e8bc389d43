"""A chat task for a small real model (`smollm2.py`): times tables, rewarded by an exact parse of the final number.

    prompt   [{"role": "user", "content": "What is 7 times 8? End your reply with the final number."}]
    answer   "56"

a is uniform on 2..9 and b on 2..12 (88 problems). The completion is rewarded 1.0 when its final number, the last
number in the text followed by nothing but ASCII punctuation, spaces or markdown (``"... is 56."``, ``"**56**"``),
equals a·b; 0.0 otherwise, including a reply that ends in words or other text (the prompt asks for the number last),
an ambiguous number (``"5,6"``) and, with `make_times_table_reward`, a reply cut off by the length cap. A small
instruct model sampled at temperature 1 solves some but not all rollouts of most of these problems, with replies from
a bare number to a worked paragraph: rows of one group differ in outcome and in cost.
"""

from __future__ import annotations

import random
import re
from typing import Any

PROMPT = "What is {a} times {b}? End your reply with the final number."
A_RANGE = (2, 9)
B_RANGE = (2, 12)
# A number (digits, or digits in groups of three with thousands commas; optional decimals), not glued to a digit,
# comma or point before it, followed only by ASCII punctuation, spaces or markdown to the end of the text.
_FINAL_NUMBER_RE = re.compile(r"(?<![\d,.])(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)[\s.,!?*_`'\"()\[\]{}<>:;~$\\-]*$")


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
    """The completion's final number (`_FINAL_NUMBER_RE`: the last number, followed only by ASCII punctuation,
    spaces or markdown up to the end of the text), thousands commas removed; None when the text does not end with a
    number, or ends with one that is ambiguous (``"5,6"``, ``"1,0245"``)."""
    match = _FINAL_NUMBER_RE.search(completion_text(completion).strip())
    if match is None:
        return None
    try:
        return float(match.group(1).replace(",", ""))
    except ValueError:  # e.g. "1,,": not a number
        return None


def times_table_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when `final_number` of the completion equals the answer exactly, else 0.0.

    It sees only the text, so it cannot tell a reply cut off by the length cap from a finished one; train with
    `make_times_table_reward`, which can."""
    out = []
    for completion, a in zip(completions, answer, strict=True):
        value = final_number(completion)
        out.append(1.0 if value is not None and value == float(a) else 0.0)
    return out


def make_times_table_reward(eos_token_ids):
    """`times_table_reward` that also gives 0.0 to a reply cut off by the length cap: one whose token ids (TRL's
    ``completion_ids`` argument, which keep the end-of-sequence token of a finished reply) are empty or do not end
    with one of `eos_token_ids` (an int or a collection of ints: the tokenizer's EOS, and its pad token where TRL
    pads with it). Called without ``completion_ids`` it raises: it is built to see them."""
    eos = {int(eos_token_ids)} if isinstance(eos_token_ids, int) else {int(i) for i in eos_token_ids}
    if not eos:
        raise ValueError("make_times_table_reward: eos_token_ids is empty")

    def times_table_reward_finished(completions, answer, completion_ids=None, **kwargs) -> list[float]:
        if completion_ids is None:
            raise TypeError("times_table_reward_finished needs completion_ids (TRL passes them to reward functions)")
        scores = times_table_reward(completions, answer)
        return [s if ids and int(ids[-1]) in eos else 0.0 for s, ids in zip(scores, completion_ids, strict=True)]

    return times_table_reward_finished
