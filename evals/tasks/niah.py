"""Needle in a haystack: gkamradt's length x depth grid and RULER's niah_* variants.

A needle reads "One of the special magic numbers for brave-lantern is: 4812093." The queried
needle sits at the cell's depth (the sentence boundary at or before it); other needles (more
values, more queried keys, distractor keys) sit at seeded random depths. The head and question
are the task's `template` (templates.py: "k3ray" or RULER's own "ruler", with its singular form
for one asked value).
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
from k3ray.evals.tasks.templates import DEFAULT_TEMPLATE, NEEDLE_TEMPLATES, NeedleTemplate, needle_template

HAYSTACKS = ("essay", "noise", "needles")
KINDS = ("words", "numbers", "uuids")
# every named template's question: k3ray's, RULER's plural and RULER's singular ("What is the special magic number")
_QUESTION = re.compile(r"What (?:are all|is) the special magic (\w+?)s? for (.+?) mentioned in the "
                       r"(?:text above|provided text)\?")


def needle(noun: str, key: str, value: str) -> str:
    """The k3ray template's needle sentence."""
    return NEEDLE_TEMPLATES["k3ray"].needle.format(noun=noun, key=key, value=value)


QUESTION_START = "\nWhat are all the special magic "  # the k3ray template's question


def question(noun: str, query: str) -> str:
    """The k3ray template's tail: the question, then the start of the answer the model completes."""
    return NEEDLE_TEMPLATES["k3ray"].plural.format(noun=noun, query=query).tail


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
    template: str | NeedleTemplate = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        needle_template(self.template)  # a ValueError names the known templates
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
        form = needle_template(self.template).needle
        return hs.generated_haystack(
            lambda: form.format(noun=self.values, key=self._draw(stream_rng, self.keys, 1, taken)[0],
                                value=self._draw(stream_rng, self.values, 1)[0]) + " "
        )

    def layout(self, rng: random.Random, cell: Cell, count: Callable[[str], int], budget: int) -> Layout:
        depth = pick_depth(rng, cell)
        keys = self._draw(rng, self.keys, self.num_keys)
        values = self._draw(rng, self.values, self.num_keys * self.num_values)
        queried = keys[: self.num_queries]
        template = needle_template(self.template)
        needles = []
        for k, key in enumerate(keys):
            for v in range(self.num_values):
                fraction = depth / 100 if (k, v) == (0, 0) else rng.random()
                value = values[k * self.num_values + v]
                needles.append((fraction, template.needle.format(noun=self.values, key=key, value=value)))
        answers = tuple(values[: self.num_queries * self.num_values])
        haystack = self._haystack(rng, frozenset(keys))
        wording = template.wording(self.values, queried, len(answers))
        return Layout.inserted(wording.head, haystack, needles, wording.tail, answers, depth)


def read(prompt: Prompt) -> str | None:
    """What a perfect reader answers: every value the text gives for the queried keys."""
    if not isinstance(prompt, str):
        return None
    questions = _QUESTION.findall(prompt)
    if not questions:
        return None
    noun, query = questions[-1]
    found = []
    for key in re.split(r",? and |, ", query):
        found += re.findall(rf"One of the special magic {noun}s for {re.escape(key)} is: ([\w-]+)\.", prompt)
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
