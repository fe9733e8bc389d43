r"""Reward functions for math answers and output format, usable as TRL reward functions.

Every function takes ``completions`` (strings, or lists of messages for conversational datasets) plus the dataset
columns as keyword arguments, and returns one float per completion, or ``None`` for a row it cannot score (TRL then
skips that reward for the row).

- `gsm8k_accuracy_reward`: numeric answers. The reference is the number after ``####`` (GSM8K's ``answer`` column);
  the model's answer is its ``#### n``, else its last ``\boxed{}``, else its ``<answer>`` tag, else the last number in
  the completion. Commas, ``$``, ``%``, units and trailing periods are ignored; ``3.50`` equals ``3.5``.
- `math_accuracy_reward`: MATH-style answers. The reference is the last ``\boxed{}`` of a worked solution (MATH's
  ``solution`` column), the part after ``####``, or the whole string (a bare final answer such as ``\frac{1}{3}``).
  The model must mark its answer (``\boxed{}``, ``<answer>...</answer>``, ``#### ...`` or "the answer is ...").
  Answers are compared after LaTeX normalisation (``\dfrac``/``\tfrac``/``a/b`` as ``\frac``, ``\left``/``\right``,
  spacing commands, ``^\circ``, ``\%``, ``\$``, ``\text{}`` units, ``x =`` prefixes, ``\frac12``), then as exact
  rationals, then element-wise for tuples and intervals. If the optional ``math_verify`` package is importable, it
  is asked as well when the normaliser finds no match.
- `think_answer_format_reward` (``<think>...</think><answer>...</answer>``) and `boxed_format_reward` (a complete
  ``\boxed{...}``).

The accuracy functions read the reference from the ``answer`` column, or from ``solution`` when there is no
``answer`` column (TRL's convention, e.g. ``trl-lib/DeepMath-103K``).
"""

from __future__ import annotations

import re
from fractions import Fraction

try:  # optional, used only when already installed
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify
except Exception:  # noqa: BLE001  # pragma: no cover - optional, and broken installs must not break us
    _mv_parse = _mv_verify = None

__all__ = [
    "boxed_format_reward",
    "completion_text",
    "extract_boxed",
    "extract_gsm8k_answer",
    "extract_math_answer",
    "gsm8k_accuracy_reward",
    "is_equiv",
    "math_accuracy_reward",
    "normalize_math_answer",
    "parse_number",
    "think_answer_format_reward",
]


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


# ---------------------------------------------------------------------------------------------------- extraction
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last complete ``\boxed{...}`` / ``\fbox{...}`` in `text`, nested braces allowed.

    ``\boxed 5`` (no braces) gives ``5``. None when there is no complete box.
    """
    for match in reversed(list(_BOXED_RE.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : i].strip()
            continue  # unbalanced: try an earlier box
        token = re.match(r"[^\s$]+", text[start:])
        if token and match.group(0).endswith(" "):
            return token.group(0).rstrip(".")
    return None


_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*[:\s]*(.+?)(?:\.\s*$|\.\s+|\n|$)", re.IGNORECASE)

# 1,234,567.89 (groups of three), 1234.5, .5; an optional sign.
_NUMBER_RE = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


def _last_tag(text: str) -> str | None:
    found = _TAG_RE.findall(text)
    return found[-1].strip() if found else None


def _last_hash(text: str) -> str | None:
    found = _HASH_RE.findall(text)
    return found[-1].strip() if found else None


def extract_math_answer(text: str) -> str | None:
    r"""The answer a completion marks: inside ``<answer>`` (its ``\boxed{}`` if any), else the last ``\boxed{}``, else
    after ``####``, else after "the answer is" / "final answer:". None when the answer is not marked."""
    tagged = _last_tag(text)
    if tagged is not None:
        return extract_boxed(tagged) or tagged
    for found in (extract_boxed(text), _last_hash(text)):
        if found:
            return found
    matches = _ANSWER_IS_RE.findall(text)
    if matches:
        inner = matches[-1].strip()
        return inner.strip("$ ").rstrip(".") or None
    return None


def extract_reference(reference) -> str | None:
    r"""The final answer of a reference: after ``####`` (GSM8K), else its last ``\boxed{}`` (MATH), else the whole
    string. None for an empty reference."""
    if reference is None:
        return None
    text = str(reference).strip()
    if not text:
        return None
    return _last_hash(text) or extract_boxed(text) or text


def extract_gsm8k_answer(text: str) -> str | None:
    r"""A completion's numeric answer: after its last ``####``, else in its last ``\boxed{}``, else in its
    ``<answer>`` tag, else its last number. Returned as a plain number string (``"-1234.5"``) or None."""
    for candidate in (_last_hash(text), extract_boxed(text), _last_tag(text)):
        if candidate:
            value = _number_in(candidate)
            if value is not None:
                return value
    return _last_number(text)


def _number_in(text: str) -> str | None:
    """The number a short answer string stands for: the whole string when it parses, else its last number."""
    value = parse_number(text)
    if value is not None:
        return _format_fraction(value)
    return _last_number(text)


def _last_number(text: str) -> str | None:
    found = _NUMBER_RE.findall(text.replace("$", " ").replace("\\", " "))
    return found[-1].replace(",", "") if found else None


def _format_fraction(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


# ---------------------------------------------------------------------------------------------------- normalisation
def _unwrap_command(text: str, command: str, keep: bool) -> str:
    r"""Replace every ``\command{...}`` (balanced braces) with its content (`keep`) or with nothing."""
    pattern = re.compile(r"\\" + command + r"\s*\{")
    while True:
        match = pattern.search(text)
        if not match:
            return text
        depth, end = 0, None
        for i in range(match.end() - 1, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    end = i
                    break
        if end is None:  # unbalanced: drop the command name only
            return text[: match.start()] + text[match.end() - 1 :]
        inner = text[match.end() : end] if keep else ""
        text = text[: match.start()] + inner + text[end + 1 :]


def _fix_fracs(text: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{2}`` -> ``\frac{1}{2}``, ``\frac{1}2`` -> ``\frac{1}{2}``."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        args = []
        rest = part
        for _ in range(2):
            if rest.startswith("{"):
                depth = 0
                for i, ch in enumerate(rest):
                    depth += ch == "{"
                    depth -= ch == "}"
                    if depth == 0:
                        args.append(rest[: i + 1])
                        rest = rest[i + 1 :]
                        break
                else:
                    break
            elif rest:
                args.append("{" + rest[0] + "}")
                rest = rest[1:]
        out += "".join(args) + rest
    return out


_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\quad", "\\qquad")
_UNIT_WORDS = re.compile(
    r"(?<=[\d}])\s*(?:units?|degrees?|cm|centimeters?|meters?|m|km|inches?|in|feet|ft|miles?|mph|hours?|minutes?|"
    r"seconds?|days?|weeks?|years?|dollars?|cents?|pounds?|kg|grams?|g|square|sq)\b.*$"
)


def normalize_math_answer(text: str) -> str:
    r"""A canonical string for a LaTeX answer (Hendrycks-style normalisation, extended). Used for string equality."""
    s = str(text).strip()
    s = s.replace("\n", " ").replace("\\displaystyle", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\bigl", "").replace("\\bigr", "")
    for sp in _SPACING:
        s = s.replace(sp, " " if sp in ("\\ ", "~", "\\quad", "\\qquad") else "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("°", "").replace("\\circ", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:mathrm|mathbf|textbf|mathit|operatorname)\s*\{", r"\\text{", s)
    # \text{...}: the whole answer -> its content; next to other content -> a unit or a word, dropped.
    stripped = s.strip()
    if re.fullmatch(r"\\(?:text|mbox)\s*\{.*\}", stripped) and _unwrap_command(stripped, "text", keep=False) == "":
        s = _unwrap_command(_unwrap_command(stripped, "mbox", keep=True), "text", keep=True)
    else:
        s = _unwrap_command(_unwrap_command(s, "mbox", keep=False), "text", keep=False)
    s = _UNIT_WORDS.sub("", s.strip())
    s = s.replace("\\{", "{").replace("\\}", "}")
    # "x = 5", "k=5": a short variable name on the left of a single "=".
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if re.fullmatch(r"\s*[a-zA-Z](?:_\{?\w+\}?)?\s*", lhs) or re.fullmatch(r"\s*\\[a-zA-Z]+\s*", lhs):
            s = rhs
    s = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = s.rstrip(".").strip()
    # 10,000 -> 10000 when the commas are thousands separators of a single number.
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    # Plain a/b between integers -> \frac{a}{b}; .5 -> 0.5
    s = re.sub(r"^(-?)(\d+)/(\d+)$", r"\1\\frac{\2}{\3}", s)
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    if s.startswith("{") and s.endswith("}") and _balanced(s[1:-1]):
        s = s[1:-1]
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += ch == "{"
        depth -= ch == "}"
        if depth < 0:
            return False
    return depth == 0


_FRAC_RE = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")


def parse_number(text) -> Fraction | None:
    r"""An exact rational for a numeric answer string, else None.

    Accepts ``1,234``, ``$3.50``, ``-0.5``, ``.5``, ``50\%``, ``3/4``, ``\frac{3}{4}``, ``-\dfrac34``, ``18.``,
    ``12 dollars``. Not accepted (None): expressions such as ``2\sqrt{3}`` or ``\pi``.
    """
    if text is None:
        return None
    s = normalize_math_answer(str(text))
    try:
        if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s):
            return Fraction(s)
        match = _FRAC_RE.match(s)
        if match:
            value = Fraction(match.group(2)) / Fraction(match.group(3))
            return -value if match.group(1) else value
    except (ValueError, ZeroDivisionError):
        return None
    return None


_OPEN_CLOSE = {"(": ")", "[": "]", "{": "}"}


def _split_top_level(s: str) -> tuple[str, list[str], str] | None:
    """``(a,b]`` -> (``(``, [``a``, ``b``], ``]``); a bare ``a,b`` list -> ("", [...], ""). None if not a list."""
    opener, closer = "", ""
    body = s
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}":
        opener, closer, body = s[0], s[-1], s[1:-1]
    items, depth, current = [], 0, ""
    for ch in body:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    if len(items) < 2:
        return None
    return opener, items, closer


def is_equiv(prediction, reference) -> bool:
    """Whether two final answers are equal: normalised strings, exact rationals, or element-wise for tuples."""
    if prediction is None or reference is None:
        return False
    a, b = normalize_math_answer(prediction), normalize_math_answer(reference)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = parse_number(a), parse_number(b)
    if x is not None and y is not None:
        return x == y
    la, lb = _split_top_level(a), _split_top_level(b)
    if la and lb and la[0] == lb[0] and la[2] == lb[2] and len(la[1]) == len(lb[1]):
        return all(is_equiv(p, r) for p, r in zip(la[1], lb[1], strict=True))
    return False


def _math_verify_equiv(prediction: str, reference: str) -> bool:
    if _mv_verify is None:
        return False
    try:
        gold = _mv_parse(f"${reference}$")
        pred = _mv_parse(f"${prediction}$")
        return bool(gold and pred and _mv_verify(gold, pred))
    except Exception:  # noqa: BLE001 - math_verify raises on odd input or timeouts: treat as "not shown equal"
        return False


# ---------------------------------------------------------------------------------------------------- rewards
def gsm8k_accuracy_reward(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    r"""1.0 when the completion's numeric answer equals the reference number, else 0.0; None when the reference has
    no number.

    Reference: GSM8K's ``"...\n#### 1,234"`` (or any string whose final answer is a number). Completion: its
    ``#### n``, ``\boxed{n}``, ``<answer>n</answer>``, else its last number.
    """
    refs = _references(answer, solution, len(completions))
    rewards, parsed = [], []
    for completion, ref in zip(completions, refs, strict=True):
        ref_text = extract_reference(ref)
        gold = parse_number(ref_text)
        if gold is None and ref_text and "\\" not in ref_text:  # plain text ("72 clips"); LaTeX must parse whole
            gold = parse_number(_last_number(ref_text))
        if gold is None:
            rewards.append(None)
            parsed.append("[no reference]")
            continue
        pred = extract_gsm8k_answer(completion_text(completion))
        value = parse_number(pred)
        rewards.append(1.0 if value is not None and value == gold else 0.0)
        parsed.append(pred or "[none]")
    _log(kwargs, "gsm8k_parsed", parsed)
    return rewards


def math_accuracy_reward(completions, answer=None, solution=None, **kwargs) -> list[float | None]:
    r"""1.0 when the completion's marked final answer equals the reference's, else 0.0; None for an empty reference.

    Reference: a worked solution with ``\boxed{}`` (MATH), ``"... #### n"`` (GSM8K), or a bare final answer.
    Completion: ``<answer>...</answer>``, the last ``\boxed{}``, ``#### ...`` or "the answer is ..."; an unmarked
    answer scores 0.
    """
    refs = _references(answer, solution, len(completions))
    rewards, parsed = [], []
    for completion, ref in zip(completions, refs, strict=True):
        gold = extract_reference(ref)
        if gold is None:
            rewards.append(None)
            parsed.append("[no reference]")
            continue
        pred = extract_math_answer(completion_text(completion))
        ok = pred is not None and (is_equiv(pred, gold) or _math_verify_equiv(pred, gold))
        rewards.append(1.0 if ok else 0.0)
        parsed.append(pred if pred is not None else "[none]")
    _log(kwargs, "math_parsed", parsed)
    return rewards


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


def _log(kwargs: dict, name: str, values: list) -> None:
    log_extra = kwargs.get("log_extra")
    if callable(log_extra):
        log_extra(name, values)
