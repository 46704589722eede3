"""Cells, items and the task interface shared by every generator."""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from k3ray.evals import haystack as hs
from k3ray.evals.fit import fit_to_length
from k3ray.evals.target import Prompt, Target, as_user_message, chat_overhead, count_chat_tokens, count_tokens

# RULER draws a needle depth from 40 evenly spaced percentages when none is given
RANDOM_DEPTHS = tuple(round(100 * i / 39, 2) for i in range(40))
# share of the token budget a counting task leaves to its filler, which absorbs the estimate's error
FILLER_SHARE = 0.05
T = TypeVar("T")


@dataclass(frozen=True)
class Cell:
    """One unit of work: a task at one length (tokens, images or frames), one depth, one sample."""

    task: str
    length: int
    depth: float | None
    sample: int = 0

    @property
    def key(self) -> str:
        depth = "rand" if self.depth is None else f"{self.depth:g}"
        return f"{self.task}/L{self.length}/D{depth}/S{self.sample}"


@dataclass(frozen=True)
class Item:
    """A generated prompt with its references; `prompt_tokens` is the verified count of a text prompt,
    or the target's count of a chat prompt (None when it cannot tell)."""

    prompt: Prompt
    answers: tuple[str, ...]
    metric: str
    max_tokens: int
    prompt_tokens: int | None = None
    needle_depth: float | None = None


def cell_rng(seed: int, cell: Cell) -> random.Random:
    digest = hashlib.sha256(f"{seed}|{cell.key}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def pick_depth(rng: random.Random, cell: Cell) -> float:
    return rng.choice(RANDOM_DEPTHS) if cell.depth is None else cell.depth


def question_in(prompt: Prompt, question: re.Pattern[str]) -> re.Match[str] | None:
    """A task's question in a text prompt; None for a chat prompt or another task's prompt."""
    return question.search(prompt) if isinstance(prompt, str) else None


def fit_counted_core(
    build: Callable[[int], tuple[T, str]], count: Callable[[str], int], head: str, tail: str,
    tokens_per_unit: float, budget: int, what: str,
) -> tuple[T, str]:
    """The core of a counting task, `build(n)` -> (what its answers need, core text starting with
    `head`) for n units, sized from the per-unit estimate and shrunk until core + tail is under
    `budget` with about FILLER_SHARE of it left for the filler."""
    fixed = count(head + tail)
    n = int((budget - fixed) * (1 - FILLER_SHARE) / tokens_per_unit)
    for _ in range(8):
        built, core = build(n)
        used = count(core + tail)
        if used < budget:
            return built, core
        n = int(n * (budget - fixed) / (used - fixed) * (1 - FILLER_SHARE))
    raise ValueError(f"could not fit {what} into {budget} tokens")


def counted_core_min_budget(count: Callable[[str], int], head: str, tail: str, tokens_per_unit: float,
                            min_units: int) -> int:
    """The smallest prompt budget `fit_counted_core` sizes to at least `min_units` units."""
    return math.ceil(count(head + tail) + min_units * tokens_per_unit / (1 - FILLER_SHARE)) + 1


class Task(ABC):
    name: str
    metric: str = "all"
    max_tokens: int = 64
    uses_depth: bool = True
    unit: str = "tokens"
    min_length = 1  # the shortest cell length in `unit`, checked before a run starts (text: min_prompt_tokens too)

    def min_prompt_tokens(self, count: Callable[[str], int]) -> int:
        """The shortest prompt (in `count`'s tokens) this task can build; checked before a run starts."""
        return 1

    def cells(self, lengths: Sequence[int], depths: Sequence[float] | None, samples: int) -> list[Cell]:
        """The grid: lengths x depths x samples; depth None means a seeded random depth per cell."""
        depth_axis = list(depths) if (self.uses_depth and depths) else [None]
        return [Cell(self.name, length, depth, s) for length in lengths for depth in depth_axis for s in range(samples)]

    @abstractmethod
    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False,
              chat: bool = False) -> Item:
        """The cell's item; `chat`: a text prompt goes as one user message (media prompts are chats)."""


@dataclass(frozen=True)
class Layout:
    """A text item before sizing: `render(n)` is the prompt around n haystack characters."""

    render: Callable[[int], str]
    answers: tuple[str, ...]
    depth: float | None = None

    @staticmethod
    def inserted(head: str, haystack: hs.CycledText | hs.StreamedText, inserts: Sequence[tuple[float, str]],
                 tail: str, answers: tuple[str, ...], depth: float) -> "Layout":
        """head, the haystack's first n characters with each (fraction, text) insert at its depth, tail."""
        return Layout(lambda n: head + hs.insert_at_depths(haystack.prefix(n), inserts) + tail, answers, depth)

    @staticmethod
    def filled(core: str, filler: hs.CycledText | hs.StreamedText, tail: str, answers: tuple[str, ...]) -> "Layout":
        """core, the filler's first n characters, tail."""
        return Layout(lambda n: core + filler.prefix(n) + tail, answers)


class TextTask(Task):
    """A text task whose prompt is sized to exactly `length` tokens of the target's tokenizer."""

    @abstractmethod
    def layout(self, rng: random.Random, cell: Cell, count: Callable[[str], int], budget: int) -> Layout: ...

    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False,
              chat: bool = False) -> Item:
        """`chat`: the same text (same seed, same needles) as one user message, `length` tokens with the
        chat template's, so it holds that many fewer of its own."""
        template = chat_overhead(target) if chat else 0
        budget = cell.length - (self.max_tokens if reserve_generation else 0) - template
        if budget < 1:
            raise ValueError(f"length {cell.length} leaves no prompt room after {self.max_tokens} generated tokens"
                             + (f" and {template} of the chat template" if chat else ""))
        count = functools.partial(count_tokens, target)
        layout = self.layout(cell_rng(seed, cell), cell, count, budget)
        prompt, _ = fit_to_length(layout.render, count, budget)
        if not chat:
            return Item(prompt, layout.answers, self.metric, self.max_tokens, budget, layout.depth)
        messages = as_user_message(prompt)
        return Item(messages, layout.answers, self.metric, self.max_tokens, count_chat_tokens(target, messages),
                    layout.depth)
