"""A built-in task whose prompt and answer lengths grow together: sums of single digits with a worked chain.

    prompt   "3+5+2="
    solution "8,10|10"     (running sums after each added term, then "|" and the final answer; EOS follows)

A one-term problem is ``"7="`` -> ``"|7"``; a four-term problem needs three running sums. So a longer problem costs
more tokens to prompt *and* to answer (5 tokens for ``"7=|7<eos>"``, up to 19 for four terms, more for a rollout
that does not stop), and is also harder, which is the setting cost-aware sampling is about.

The default task has 1 to `DEFAULT_MAX_TERMS` (4) terms: the embedded 138k-parameter model cannot really learn more
(greedy accuracy on five- and six-term sums stays below 0.5), so longer problems only add all-wrong groups. The earlier
default task (1 to 6 terms) is ``max_terms=6`` (`LEGACY_MAX_TERMS`).
"""

from __future__ import annotations

import random
import re
from typing import Any

SEPARATOR = "|"
_FORMAT_RE = re.compile(r"^(\d+(,\d+)*)?\|\d+$")
DEFAULT_MAX_TERMS = 4
LEGACY_MAX_TERMS = 6


def max_completion_tokens(max_terms: int = DEFAULT_MAX_TERMS) -> int:
    """An upper bound on the tokens of a correct completion with `max_terms` terms, EOS included: ``3·max_terms``
    (k − 1 running sums of at most two digits, k − 2 commas, ``|``, a two-digit answer, EOS). 12 for four terms."""
    return 3 * max_terms


def make_problem(terms: list[int]) -> dict[str, Any]:
    """The prompt, solution and answer for one list of terms."""
    prompt = "+".join(str(t) for t in terms) + "="
    running, total = [], terms[0]
    for t in terms[1:]:
        total += t
        running.append(str(total))
    answer = str(sum(terms))
    solution = ",".join(running) + SEPARATOR + answer
    return {"prompt": prompt, "answer": answer, "solution": solution, "num_terms": len(terms)}


def arithmetic_dataset(
    n: int,
    *,
    seed: int = 0,
    min_terms: int = 1,
    max_terms: int = DEFAULT_MAX_TERMS,
    conversational: bool = False,
):
    """`n` problems; the number of terms is uniform on [min_terms, max_terms], each term uniform on 0..9.

    Columns: ``prompt`` (str, or ``[{"role": "user", "content": ...}]`` when `conversational`), ``answer`` (str),
    ``solution`` (str, the full correct completion without EOS) and ``num_terms`` (int). Deterministic given `seed`.
    """
    from datasets import Dataset

    if not 1 <= min_terms <= max_terms:
        raise ValueError(f"need 1 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(min_terms, max_terms)
        row = make_problem([rng.randint(0, 9) for _ in range(k)])
        if conversational:
            row["prompt"] = [{"role": "user", "content": row["prompt"]}]
        rows.append(row)
    if not rows:
        return Dataset.from_dict({"prompt": [], "answer": [], "solution": [], "num_terms": []})
    return Dataset.from_list(rows)


def _completion_text(completion) -> str:
    """A completion as TRL passes it: a string, or a list of messages (conversational)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        return _completion_text(completion[-1])
    return str(completion)


def _clean(text: str) -> str:
    # Completions normally arrive with special tokens skipped; cut at an EOS/pad that was left in, just in case.
    for stop in ("<eos>", "<pad>"):
        text = text.split(stop, 1)[0]
    return text.strip()


def extract_answer(completion) -> str | None:
    """The final answer of a completion: what follows the first ``|``, stripped; None when there is no ``|``."""
    text = _clean(_completion_text(completion))
    if SEPARATOR not in text:
        return None
    return text.split(SEPARATOR, 1)[1].strip()


def arithmetic_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the text after the first ``|`` equals `answer` exactly, else 0.0.

    Strict on purpose: anything after the answer (the model not stopping) scores 0, so RL also learns to emit EOS.
    The running sums are not checked; use `arithmetic_format_reward` for a format signal.
    """
    return [1.0 if extract_answer(c) == str(a).strip() else 0.0 for c, a in zip(completions, answer, strict=True)]


def arithmetic_format_reward(completions, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when a completion looks like ``"8,10|10"`` (digits, commas, one ``|``, digits)."""
    return [1.0 if _FORMAT_RE.match(_clean(_completion_text(c))) else 0.0 for c in completions]
