"""The "long" built-in task: count through a cyclic alphabet from one letter to another, writing every letter.

    prompt   "x-c="
    solution "x,y,z,A,B,...,Z,a,b,c"     (EOS follows)

The alphabet is ``a..z`` then ``A..Z`` (52 letters), read cyclically: after ``Z`` comes ``a``. A short prompt
(4 tokens) asks for a completion whose length is set by the problem: 2·(span + 1) tokens with EOS, span being how
many steps separate the two letters (0 to `DEFAULT_MAX_SPAN`), so 2 to 80 tokens. That is the shape of a reasoning
rollout: the prompt is a small share of a rollout's cost, completions of one batch differ in length by an order of
magnitude, and a sampled completion that misses its stop goes on round the alphabet until the length cap (a
truncated rollout, always wrong), so wrong answers are longer than right ones. The reward is strict: the completion
must be exactly the list, nothing after it.

Each letter is one token, so the next letter is a one-token rule and the stop is one comparison with the prompt's
last letter: a 138k-parameter model learns both, and sampled at T = 1 it still slips (a skipped letter, a missed or
early stop), more often on longer problems.
"""

from __future__ import annotations

import random
import string
from typing import Any

from .arithmetic import _clean, _completion_text

ALPHABET = string.ascii_lowercase + string.ascii_uppercase  # 52 letters, read cyclically
DEFAULT_MAX_SPAN = 39  # 40 letters = 80 tokens with EOS
LONG_MAX_COMPLETION_LENGTH = 96  # the long recipe's cap: every correct completion fits, a run-on one is truncated
RUN_ON_LETTERS = 64  # a warm-up run-on completion: 127 tokens before EOS, beyond the cap


def counting_completion_tokens(span: int) -> int:
    """Tokens of the correct completion `span` steps long, EOS included: one per letter, commas between, EOS."""
    return 2 * (span + 1)


def make_count_problem(start: str, span: int) -> dict[str, Any]:
    """The prompt, solution and span of counting `span` steps from the letter `start` (cyclically)."""
    if start not in ALPHABET or len(start) != 1:
        raise ValueError(f"start must be one letter of {ALPHABET!r}, got {start!r}")
    if not 0 <= span < len(ALPHABET):
        raise ValueError(f"span must be in 0..{len(ALPHABET) - 1}, got {span}")
    i = ALPHABET.index(start)
    letters = [ALPHABET[(i + k) % len(ALPHABET)] for k in range(span + 1)]
    solution = ",".join(letters)
    return {"prompt": f"{start}-{letters[-1]}=", "answer": solution, "solution": solution, "span": span}


def run_on_completion(solution: str, letters: int = RUN_ON_LETTERS) -> str:
    """`solution` continued past its last letter, round the alphabet, to `letters` letters in all: the warm-up's
    flawed completion (2·`letters` − 1 tokens before EOS, longer than the cap, so a model that has picked up the habit
    is truncated). Scored 0 by `counting_reward`."""
    last = solution[-1]
    i = ALPHABET.index(last)
    have = solution.count(",") + 1
    extra = [ALPHABET[(i + k) % len(ALPHABET)] for k in range(1, max(0, letters - have) + 1)]
    return ",".join([solution, *extra]) if extra else solution


def counting_dataset(n: int, *, seed: int = 0, max_span: int = DEFAULT_MAX_SPAN, conversational: bool = False):
    """`n` problems: the start letter uniform on the alphabet, the span uniform on 0..`max_span`.

    Columns: ``prompt``, ``answer`` (= ``solution``, the full correct completion without EOS), ``solution``, ``span``.
    Deterministic given `seed`."""
    from datasets import Dataset

    if not 0 <= max_span < len(ALPHABET):
        raise ValueError(f"max_span must be in 0..{len(ALPHABET) - 1}, got {max_span}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        row = make_count_problem(rng.choice(ALPHABET), rng.randint(0, max_span))
        if conversational:
            row["prompt"] = [{"role": "user", "content": row["prompt"]}]
        rows.append(row)
    if not rows:
        return Dataset.from_dict({"prompt": [], "answer": [], "solution": [], "span": []})
    return Dataset.from_list(rows)


def counting_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion is exactly the list (``"x,y,z,A"``), else 0.0."""
    return [1.0 if _clean(_completion_text(c)) == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]
