"""A chat task whose prompts are long and vary: a times-table question behind a passage of notes.

    prompt   [{"role": "user", "content": "Read the notes, then answer the question.\\n\\nNotes:\\n<passage>\\n\\n
              Question: How many pears did Omar pack in all? End your reply with the final number."}]
    answer   "56"

The passage is a list of notes from a market day, built from templates with names, goods, places and numbers. One
note is the key: ``"Omar packed 7 crates with 8 pears in each crate."``; the others are distractors (other people
packing other goods, opening hours, prices, weather), each with its own numbers, so the reply has to find the key
note. The number of notes is drawn log-uniformly from `NOTES_RANGE`, so prompt lengths spread over more than a factor
of 10 (about 50 to 700 tokens for SmolLM2's tokenizer), and the key note is at a uniform position. a (crates) is
uniform on 2..9 and b (per crate) on 2..12, as in `times_table`; the reward is the same exact parse of the final
number (`times_table.final_number`), 0 for a reply cut off by the length cap with `make_passage_table_reward`.
Deterministic given the seed.
"""

from __future__ import annotations

import math
import random

from .times_table import A_RANGE, B_RANGE, make_times_table_reward, times_table_reward

INSTRUCTION = "Read the notes, then answer the question."
QUESTION = "How many {goods} did {name} pack in all? End your reply with the final number."
KEY = "{name} packed {a} crates with {b} {goods} in each crate."
NOTES_RANGE = (1, 34)  # notes per passage, the key note included: drawn log-uniformly
NAMES = (
    "Omar", "Lena", "Ravi", "Mara", "Tomas", "Ines", "Kofi", "Yuki", "Pavel", "Sara", "Diego", "Amina", "Jonas",
    "Priya", "Felix", "Noor", "Hugo", "Zara", "Ivan", "Lucia", "Emeka", "Hana", "Oskar", "Rosa",
)  # fmt: skip
GOODS = (
    "pears", "apples", "plums", "lemons", "onions", "carrots", "eggs", "melons", "peaches", "limes", "potatoes",
    "figs", "beets", "tomatoes", "radishes", "apricots",
)  # fmt: skip
PLACES = ("the bakery", "the fish stall", "the north gate", "the flower stand", "the dairy", "the tool shop")
WEATHER = ("rain", "wind", "fog", "sun", "clouds", "drizzle")
DISTRACTORS = (
    "{name} packed {x} crates with {y} {goods} in each crate.",  # the key's own form, for someone else
    "{place} opened at {x} o'clock and closed at {y} o'clock.",
    "{name} sold {goods} for {x} coins a basket and bought {y} sacks of flour.",
    "There was {weather} in the morning and about {x} carts came in before noon.",
    "{name} counted {x} empty crates behind {place}.",
    "{name} walked {x} miles to the market with {y} baskets of {goods}.",
)


def note_count(rng: random.Random, notes_range: tuple[int, int] = NOTES_RANGE) -> int:
    """Notes in a passage, log-uniform on `notes_range` (inclusive)."""
    lo, hi = notes_range
    if not 1 <= lo <= hi:
        raise ValueError(f"notes_range needs 1 <= lo <= hi, got {notes_range}")
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_passage_problem(rng: random.Random, notes_range: tuple[int, int] = NOTES_RANGE, conversational=True):
    """One problem from `rng`: ``prompt``, ``answer`` (str of a·b), ``solution``, ``a``, ``b``, ``notes`` (how many,
    the key included) and ``key_position`` (0-based)."""
    a, b = rng.randint(*A_RANGE), rng.randint(*B_RANGE)
    name, goods = rng.choice(NAMES), rng.choice(GOODS)
    n = note_count(rng, notes_range)
    others = [x for x in NAMES if x != name]
    notes = []
    for _ in range(n - 1):
        template = rng.choice(DISTRACTORS)
        other_goods = rng.choice([g for g in GOODS if g != goods])  # never the key's goods: one answer only
        notes.append(
            template.format(
                name=rng.choice(others),
                goods=other_goods,
                place=rng.choice(PLACES),
                weather=rng.choice(WEATHER),
                x=rng.randint(2, 12),
                y=rng.randint(2, 12),
            )
        )
    key_position = rng.randint(0, n - 1)
    notes.insert(key_position, KEY.format(name=name, a=a, b=b, goods=goods))
    passage = "\n".join(f"- {note[0].upper()}{note[1:]}" for note in notes)
    text = f"{INSTRUCTION}\n\nNotes:\n{passage}\n\nQuestion: {QUESTION.format(goods=goods, name=name)}"
    return {
        "prompt": [{"role": "user", "content": text}] if conversational else text,
        "answer": str(a * b),
        "solution": f"{name} packed {a} crates of {b} {goods}: {a} times {b} is {a * b}.",
        "a": a,
        "b": b,
        "notes": n,
        "key_position": key_position,
    }


def passage_table_dataset(
    n: int, *, seed: int = 0, notes_range: tuple[int, int] = NOTES_RANGE, conversational: bool = True
):
    """`n` problems drawn with `random.Random(seed)` (`make_passage_problem`); a `datasets.Dataset` with columns
    ``prompt``, ``answer``, ``solution``, ``a``, ``b``, ``notes``, ``key_position``. Deterministic given `seed`."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [make_passage_problem(rng, notes_range, conversational) for _ in range(n)]
    if not rows:
        columns = ("prompt", "answer", "solution", "a", "b", "notes", "key_position")
        return Dataset.from_dict({c: [] for c in columns})
    return Dataset.from_list(rows)


# The reward is the times-table one: the final number of the reply against a·b.
passage_table_reward = times_table_reward
make_passage_table_reward = make_times_table_reward
