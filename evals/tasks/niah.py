"""Needle in a haystack: gkamradt's length x depth grid and RULER's niah_* variants.

A needle reads "One of the special magic numbers for brave-lantern is: 4812093." The queried
needle sits at the cell's depth (the sentence boundary at or before it); other needles (more
values, more queried keys, distractor keys) sit at seeded random depths.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from k3ray.evals import haystack as hs
from k3ray.evals import words
from k3ray.evals.target import Prompt
from k3ray.evals.tasks.base import Cell, Layout, TextTask, pick_depth

HAYSTACKS = ("essay", "noise", "needles")
KINDS = ("words", "numbers", "uuids")
_QUESTION = re.compile(r"What are all the special magic (\w+) for (.+?) mentioned in the text above\?")


def needle(noun: str, key: str, value: str) -> str:
    return f"One of the special magic {noun} for {key} is: {value}."


QUESTION_START = "\nWhat are all the special magic "


def question(noun: str, query: str) -> str:
    """The prompt's tail: the question, then the start of the answer the model completes."""
    return (f"{QUESTION_START}{noun} for {query} mentioned in the text above?"
            f" The special magic {noun} for {query} mentioned in the text above are")


def join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


@dataclass(frozen=True)
class NeedleTask(TextTask):
    name: str
    haystack: str = "essay"
    keys: str = "words"
    values: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    max_tokens: int = 128
    corpus: str | None = None

    def __post_init__(self) -> None:
        if self.haystack not in HAYSTACKS:
            raise ValueError(f"haystack must be one of {HAYSTACKS}, got {self.haystack!r}")
        if self.keys not in ("words", "uuids") or self.values not in ("numbers", "uuids"):
            raise ValueError(f"keys/values must be words|uuids / numbers|uuids, got {self.keys!r}/{self.values!r}")
        if not 1 <= self.num_queries <= self.num_keys or self.num_values < 1:
            raise ValueError(f"need 1 <= num_queries <= num_keys and num_values >= 1, got {self}")

    def _draw(self, rng: random.Random, kind: str, count: int, exclude: frozenset[str] = frozenset()) -> list[str]:
        if kind == "words":
            return words.word_keys(rng, count, exclude)
        if kind == "uuids":
            return words.uuids(rng, count)
        return words.magic_numbers(rng, count)

    def _haystack(self, rng: random.Random, taken: frozenset[str]):
        if self.haystack == "essay":
            return hs.essay_haystack(self.corpus)
        if self.haystack == "noise":
            return hs.noise_haystack()
        stream_rng = random.Random(rng.getrandbits(64))
        return hs.generated_haystack(
            lambda: needle(self.values, self._draw(stream_rng, self.keys, 1, taken)[0],
                           self._draw(stream_rng, self.values, 1)[0]) + " "
        )

    def layout(self, rng: random.Random, cell: Cell, count: Callable[[str], int], budget: int) -> Layout:
        depth = pick_depth(rng, cell)
        keys = self._draw(rng, self.keys, self.num_keys)
        values = self._draw(rng, self.values, self.num_keys * self.num_values)
        queried = keys[: self.num_queries]
        needles = []
        for k, key in enumerate(keys):
            for v in range(self.num_values):
                fraction = depth / 100 if (k, v) == (0, 0) else rng.random()
                needles.append((fraction, needle(self.values, key, values[k * self.num_values + v])))
        answers = tuple(values[: self.num_queries * self.num_values])
        haystack = self._haystack(rng, frozenset(keys))
        query = join_keys(queried)
        head = (
            f"Some special magic {self.values} are hidden inside the following text. "
            f"Remember them: you will be asked about them afterwards.\n"
        )
        return Layout.inserted(head, haystack, needles, question(self.values, query), answers, depth)


def read(prompt: Prompt) -> str | None:
    """What a perfect reader answers: every value the text gives for the queried keys."""
    if not isinstance(prompt, str):
        return None
    questions = _QUESTION.findall(prompt)
    if not questions:
        return None
    noun, query = questions[-1]
    found = []
    for key in re.split(r", | and ", query):
        found += re.findall(rf"One of the special magic {noun} for {re.escape(key)} is: ([\w-]+)\.", prompt)
    return ", ".join(found)


TASKS = (
    NeedleTask("niah"),
    NeedleTask("niah_single_1", haystack="noise"),
    NeedleTask("niah_single_2"),
    NeedleTask("niah_single_3", values="uuids"),
    NeedleTask("niah_multikey_1", num_keys=4),
    NeedleTask("niah_multikey_2", haystack="needles"),
    NeedleTask("niah_multikey_3", haystack="needles", keys="uuids", values="uuids"),
    NeedleTask("niah_multivalue", num_values=4),
    NeedleTask("niah_multiquery", num_keys=4, num_queries=4),
)
