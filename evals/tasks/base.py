"""Cells, items and the task interface shared by every generator."""

from __future__ import annotations

import functools
import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from k3ray.evals.fit import fit_to_length
from k3ray.evals.target import Prompt, Target, count_tokens

# RULER draws a needle depth from 40 evenly spaced percentages when none is given
RANDOM_DEPTHS = tuple(round(100 * i / 39, 2) for i in range(40))


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
    """A generated prompt with its references; `prompt_tokens` is the verified count of a text prompt."""

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


class Task(ABC):
    name: str
    metric: str = "all"
    max_tokens: int = 64
    uses_depth: bool = True
    unit: str = "tokens"

    def cells(self, lengths: Sequence[int], depths: Sequence[float] | None, samples: int) -> list[Cell]:
        """The grid: lengths x depths x samples; depth None means a seeded random depth per cell."""
        depth_axis = list(depths) if (self.uses_depth and depths) else [None]
        return [Cell(self.name, length, depth, s) for length in lengths for depth in depth_axis for s in range(samples)]

    @abstractmethod
    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False) -> Item: ...


@dataclass(frozen=True)
class Layout:
    """A text item before sizing: `render(n)` is the prompt around n haystack characters."""

    render: Callable[[int], str]
    answers: tuple[str, ...]
    depth: float | None = None


class TextTask(Task):
    """A text task whose prompt is sized to exactly `length` tokens of the target's tokenizer."""

    @abstractmethod
    def layout(self, rng: random.Random, cell: Cell, count: Callable[[str], int], budget: int) -> Layout: ...

    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False) -> Item:
        budget = cell.length - (self.max_tokens if reserve_generation else 0)
        if budget < 1:
            raise ValueError(f"length {cell.length} leaves no prompt room after {self.max_tokens} generated tokens")
        count = functools.partial(count_tokens, target)
        layout = self.layout(cell_rng(seed, cell), cell, count, budget)
        prompt, _ = fit_to_length(layout.render, count, budget)
        return Item(prompt, layout.answers, self.metric, self.max_tokens, budget, layout.depth)
