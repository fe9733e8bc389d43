r"""Reward functions for math answers and output format, usable as TRL reward functions.

Every function takes ``completions`` (strings, or lists of messages for conversational datasets) plus the dataset
columns as keyword arguments, and returns one float per completion, or ``None`` for a row it cannot score (TRL then
skips that reward for the row).

What is ours and what is not:

- `math_accuracy_reward`: MATH-style answers. Equivalence is decided by Hugging Face's ``math-verify`` (what TRL's
  own ``accuracy_reward`` uses: LaTeX parsed to SymPy, ``\frac``/``\dfrac``/``a/b``, ``\boxed{}``, units,
  percent, intervals, sets, tuples, equations). It needs the ``math`` extra: ``pip install 'trl-costaware[math]'``.
  This module only adapts the inputs: plain-string completions, the reference in an ``answer`` or ``solution``
  column, GSM8K-style ``#### n`` references and completions, ``<answer>...</answer>`` tags, and bare final answers
  (``\frac13``, ``\text{(C)}``) as references.
- `gsm8k_accuracy_reward`: numeric answers, no extra needed. The reference is the number after ``####`` (GSM8K's
  ``answer`` column); the model's answer is its ``#### n``, else its last ``\boxed{}``, else its ``<answer>`` tag,
  else the last number in the completion. Commas, ``$``, ``%``, units and trailing periods are ignored; ``3.50``
  equals ``3.5``. Neither TRL nor math-verify has the GSM8K ``####`` convention or the "last number" rule.
- `think_answer_format_reward` (``<think>...</think><answer>...</answer>``; TRL's ``think_format_reward`` checks
  only the ``<think>`` part) and `boxed_format_reward` (a complete ``\boxed{...}``).

The accuracy functions read the reference from the ``answer`` column, or from ``solution`` when there is no
``answer`` column (TRL's convention, e.g. ``trl-lib/DeepMath-103K``).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

__all__ = [
    "boxed_format_reward",
    "completion_text",
    "extract_boxed",
    "extract_gsm8k_answer",
    "gsm8k_accuracy_reward",
    "math_accuracy_reward",
    "parse_number",
    "think_answer_format_reward",
]

MATH_EXTRA_HINT = "pip install 'trl-costaware[math]'"


# ---------------------------------------------------------------------------------------------------- completions
def completion_text(completion) -> str:
    """The text of one completion: a string, a message dict, or a list of messages (the last assistant turn)."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content", "")
        if isinstance(content, list):  # multimodal-style content parts
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return "" if content is None else str(content)
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        assistant = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        return completion_text(assistant[-1] if assistant else completion[-1])
    return str(completion)


def _references(answer, solution, n: int) -> list:
    refs = answer if answer is not None else solution
    if refs is None:
        raise ValueError(
            "math accuracy rewards need the reference in a dataset column named 'answer' (or 'solution'); "
            "rename your column, e.g. with the training script's --answer_column"
        )
    if isinstance(refs, str):
        refs = [refs] * n
    if len(refs) != n:
        raise ValueError(f"got {n} completions but {len(refs)} references")
    return list(refs)


# ---------------------------------------------------------------------------------------------------- answer markers
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASH_RE = re.compile(r"####\s*([^\n]*)")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` / ``\fbox{...}`` in `text`, nested braces allowed.

    ``\boxed 5`` (no braces) gives ``5``. None when there is no complete box.
    """
    for match in reversed(list(_BOXED_RE.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                depth += text[i] == "{"
                depth -= text[i] == "}"
                if depth == 0:
                    return text[start + 1 : i].strip()
            continue  # unbalanced: try an earlier box
        token = re.match(r"[^\s$]+", text[start:])
        if token and match.group(0).endswith(" "):
            return token.group(0).rstrip(".")
    return None


def _last_tag(text: str) -> str | None:
    found = _TAG_RE.findall(text)
    return found[-1].strip() if found else None


def _last_hash(text: str) -> str | None:
    found = _HASH_RE.findall(text)
    return found[-1].strip() if found else None


# ---------------------------------------------------------------------------------------------------- GSM8K
# 1,234,567.89 (groups of three), 1234.5, .5; an optional sign.
_NUMBER_RE = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")
_DECIMAL_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION_RE = re.compile(r"(-?)(?:\\[dt]?frac\{(\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}|(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?))")


def parse_number(text) -> Fraction | None:
    r"""An exact rational for a GSM8K-style numeric answer string, else None.

    Accepts ``1,234``, ``$3.50``, ``-0.5``, ``.5``, ``50\%`` (as 50), ``3/4``, ``\frac{3}{4}``, ``18.``,
    ``12 dollars``. Not accepted (None): expressions such as ``2\sqrt{3}`` or ``\pi``, and ``1,2`` (not a thousands
    grouping). General LaTeX answers are math-verify's job (`math_accuracy_reward`).
    """
    if text is None:
        return None
    s = re.sub(r"\\[!,;: ]", "", str(text))  # LaTeX spacing, e.g. 10,\!000
    s = re.sub(r"\\?[$%]", "", s).strip()
    s = re.sub(r"(?<=[\d}])\s*\\?(?:text\{)?\s*[a-zA-Z][a-zA-Z ]*\.?\}?$", "", s)  # a unit word: "12 dollars"
    s = s.strip().rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if _DECIMAL_RE.fullmatch(s):
            return Fraction(s)
        match = _FRACTION_RE.fullmatch(s)
        if match:
            sign, num, den = match.group(1), match.group(2) or match.group(4), match.group(3) or match.group(5)
            value = Fraction(num) / Fraction(den)
            return -value if sign else value
    except ZeroDivisionError:
        return None
    return None


def _last_number(text: str) -> str | None:
    found = _NUMBER_RE.findall(text.replace("$", " ").replace("\\", " "))
    return found[-1].replace(",", "") if found else None


def _format_fraction(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def extract_gsm8k_answer(text: str) -> str | None:
    r"""A completion's numeric answer: after its last ``####``, else in its last ``\boxed{}``, else in its
    ``<answer>`` tag, else its last number. Returned as a plain number string (``"-1234.5"``) or None."""
    for candidate in (_last_hash(text), extract_boxed(text), _last_tag(text)):
        if candidate:
            value = parse_number(candidate)
            if value is not None:
                return _format_fraction(value)
            number = _last_number(candidate)
            if number is not None:
                return number
    return _last_number(text)


def _gsm8k_reference(reference) -> Fraction | None:
    """The reference number: after ``####``, else in the last ``\\boxed{}``, else the whole string (plain text: its
    last number). None when there is none."""
    text = "" if reference is None else str(reference).strip()
    ref = _last_hash(text) or extract_boxed(text) or text
    gold = parse_number(ref)
    if gold is None and ref and "\\" not in ref:  # plain text ("72 clips"); LaTeX must parse whole
        gold = parse_number(_last_number(ref))
    return gold


def gsm8k_accuracy_reward(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    r"""1.0 when the completion's numeric answer equals the reference number, else 0.0; None when the reference has
    no number.

    Reference: GSM8K's ``"...\n#### 1,234"`` (or any string whose final answer is a number). Completion: its
    ``#### n``, ``\boxed{n}``, ``<answer>n</answer>``, else its last number. Numbers compare as exact rationals.
    """
    refs = _references(answer, solution, len(completions))
    rewards, parsed = [], []
    for completion, ref in zip(completions, refs, strict=True):
        gold = _gsm8k_reference(ref)
        if gold is None:
            rewards.append(None)
            parsed.append("[no reference]")
            continue
        pred = extract_gsm8k_answer(completion_text(completion))
        value = parse_number(pred)
        rewards.append(1.0 if value is not None and value == gold else 0.0)
        parsed.append(pred or "[none]")
    log_extra = kwargs.get("log_extra")
    if callable(log_extra):
        log_extra("gsm8k_parsed", parsed)
    return rewards


# ---------------------------------------------------------------------------------------------------- MATH
def _require_math_verify() -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"math_accuracy_reward checks answers with the `math-verify` package, which is not installed: "
            f"{MATH_EXTRA_HINT}"
        ) from err


def _math_reference(reference) -> str:
    r"""The reference as math-verify reads it: GSM8K's ``#### n`` -> ``$n$``; a text with LaTeX delimiters or a
    ``\boxed{}`` (a MATH worked solution) as is; a bare final answer (``\frac13``) inside ``$...$``. An empty
    reference gives "" (math-verify finds nothing: the row's reward is None)."""
    text = "" if reference is None else str(reference).strip()
    if not text:
        return ""
    hashed = _last_hash(text)
    if hashed:
        return f"${hashed}$"
    if _BOXED_RE.search(text) or re.search(r"(?<!\\)\$|\\\(|\\\[", text):
        return text
    return f"${text}$"


def _marked_answer(text: str) -> str:
    r"""A completion with its ``<answer>...</answer>`` (else, when it has no ``\boxed{}``, its ``#### ...``) answer
    as a ``\boxed{}``, which math-verify reads first; any other completion unchanged."""
    answer = _last_tag(text)
    if answer is None and extract_boxed(text) is None:
        answer = _last_hash(text)
    if answer is None:
        return text
    return answer if _BOXED_RE.search(answer) else f"\\boxed{{{answer}}}"


def math_accuracy_reward(completions, answer=None, solution=None, log_extra=None, **kwargs) -> list[float | None]:
    r"""1.0 when the completion's final answer is mathematically equal to the reference's (math-verify), else 0.0;
    None when math-verify finds no answer in the reference.

    Reference: a worked solution with ``\boxed{}`` (MATH), ``"... #### n"`` (GSM8K), or a bare LaTeX final answer.
    Completion: its marked answer only: ``<answer>...</answer>``, ``\boxed{}`` (first; several boxes are read as
    one set of answers), ``#### ...``, or an answer after "final answer is" / "the answer is". An unmarked answer
    scores 0.

    This calls math-verify with its default LaTeX normalisation rather than TRL's ``accuracy_reward``, whose
    normalisation leaves out math-verify's malformed-operator fixes, so that ``\boxed{\frac12}`` and
    ``\boxed{3\sqrt2}`` would score 0 there. Raises ImportError naming the ``math`` extra when ``math-verify`` is
    not installed. Logs ``gold_parsed`` and ``answer_parsed`` to TRL's completions table, as TRL does.
    """
    _require_math_verify()
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # math-verify times out with signal.alarm, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    marked = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    marked.append(ExprExtractionConfig(try_extract_without_anchor=False))
    refs = _references(answer, solution, len(completions))
    rewards, gold_parsed, answer_parsed = [], [], []
    for completion, ref in zip(completions, refs, strict=True):
        gold = parse(_math_reference(ref), parsing_timeout=timeout)
        if not gold:
            rewards.append(None)
            gold_parsed.append("[unparseable]")
            answer_parsed.append("[skipped]")
            continue
        text = _marked_answer(completion_text(completion))
        pred = parse(text, extraction_config=marked, extraction_mode="first_match", parsing_timeout=timeout)
        rewards.append(1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0)
        gold_parsed.append(str(gold[-1]))
        answer_parsed.append(str(pred[-1]) if pred else "[none]")
    if callable(log_extra):
        log_extra("gold_parsed", gold_parsed)
        log_extra("answer_parsed", answer_parsed)
    return rewards


# ---------------------------------------------------------------------------------------------------- format
_THINK_ANSWER_RE = re.compile(
    r"^\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*\S(?:(?!</?answer>).)*</answer>\s*$",
    re.DOTALL,
)


def think_answer_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when a completion is exactly ``<think>...</think>`` then ``<answer>...</answer>`` (non-empty answer)."""
    return [1.0 if _THINK_ANSWER_RE.match(completion_text(c)) else 0.0 for c in completions]


def boxed_format_reward(completions, **kwargs) -> list[float]:
    r"""1.0 when a completion contains a complete, non-empty ``\boxed{...}``, else 0.0."""
    return [1.0 if extract_boxed(completion_text(c)) else 0.0 for c in completions]
