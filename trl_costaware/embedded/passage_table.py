"""A chat task whose prompts are long and vary: a times-table question behind a passage of notes.

    prompt   [{"role": "user", "content": "Read the notes, then answer the question.\n\nNotes:\n- <note>\n...\n\n
              Question: What is 7 times 8? End your reply with the final number."}]
    answer   "56"

The passage is a list of notes from a market day, built from templates with names, goods, places and numbers (people
packing crates, opening hours, prices, weather), none of them about the question: the reply has to ignore them and
their numbers. The number of notes is drawn log-uniformly from `NOTES_RANGE`, so prompt lengths spread over more than
a factor of 10 (about 75 to 800 tokens with SmolLM2's chat template and tokenizer). a is uniform on 2..9 and b on
2..12, as in `times_table`; the reward is the same exact parse of the final number (`times_table.final_number`), 0
for a reply cut off by the length cap with `make_passage_table_reward`. Deterministic given the seed. Why the question
does not ask about the notes themselves: docs/embedded.md.
"""

from __future__ import annotations

import math
import random

from .times_table import A_RANGE, B_RANGE, make_problem, make_times_table_reward, times_table_reward

INSTRUCTION = "Read the notes, then answer the question."
NOTES_RANGE = (1, 38)  # notes per passage: drawn log-uniformly
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
NOTES = (
    "{name} packed {x} crates with {y} {goods} in each crate.",
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
    """One problem from `rng`: ``prompt``, ``answer`` (str of a·b), ``solution``, ``a``, ``b`` and ``notes`` (how
    many)."""
    a, b = rng.randint(*A_RANGE), rng.randint(*B_RANGE)
    notes = []
    for _ in range(note_count(rng, notes_range)):
        note = rng.choice(NOTES).format(
            name=rng.choice(NAMES),
            goods=rng.choice(GOODS),
            place=rng.choice(PLACES),
            weather=rng.choice(WEATHER),
            x=rng.randint(2, 12),
            y=rng.randint(2, 12),
        )
        notes.append(note[0].upper() + note[1:])
    passage = "\n".join(f"- {note}" for note in notes)
    problem = make_problem(a, b, conversational=False)  # the times-table question, answer and solution
    text = f"{INSTRUCTION}\n\nNotes:\n{passage}\n\nQuestion: {problem['prompt']}"
    problem.update(prompt=[{"role": "user", "content": text}] if conversational else text, notes=len(notes))
    return problem


def passage_table_dataset(
    n: int, *, seed: int = 0, notes_range: tuple[int, int] = NOTES_RANGE, conversational: bool = True
):
    """`n` problems drawn with `random.Random(seed)` (`make_passage_problem`); a `datasets.Dataset` with columns
    ``prompt``, ``answer``, ``solution``, ``a``, ``b``, ``notes``. Deterministic given `seed`."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [make_passage_problem(rng, notes_range, conversational) for _ in range(n)]
    if not rows:
        columns = ("prompt", "answer", "solution", "a", "b", "notes")
        return Dataset.from_dict({c: [] for c in columns})
    return Dataset.from_list(rows)


# The reward is the times-table one: the final number of the reply against a·b.
passage_table_reward = times_table_reward
make_passage_table_reward = make_times_table_reward
