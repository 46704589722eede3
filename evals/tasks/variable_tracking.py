"""RULER-style variable tracking: follow a chain of assignments hidden in noise.

"VAR QMZTA = 52071." then "VAR HRBDE = VAR QMZTA." and so on; the answer is every variable that
ends up holding the value. The chain starts at the cell's depth and continues, in order, at
seeded random depths after it; extra chains (other values) are distractors. The head and question
are the task's `template` (templates.py: "k3ray", or RULER's own "ruler").
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from k3ray.evals import haystack as hs
from k3ray.evals import words
from k3ray.evals.target import Prompt
from k3ray.evals.tasks.base import Cell, Layout, TextTask, pick_depth, question_in
from k3ray.evals.tasks.templates import DEFAULT_TEMPLATE, check_template, vt_wording

# k3ray's question, then RULER's
_QUESTION = re.compile(r"(?:Which variables are|Find all variables that are) assigned the value (\d+) in the text above[?.]")


@dataclass(frozen=True)
class VariableTracking(TextTask):
    name: str = "vt"
    num_chains: int = 1
    num_hops: int = 4
    max_tokens: int = 30
    template: str = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        check_template(self.template)
        if self.num_chains < 1 or self.num_hops < 1:
            raise ValueError(f"num_chains and num_hops must be >= 1, got {self.num_chains}, {self.num_hops}")

    def layout(self, rng: random.Random, cell: Cell, count: Callable[[str], int], budget: int) -> Layout:
        depth = pick_depth(rng, cell)
        names = words.variable_names(rng, self.num_chains * (self.num_hops + 1))
        values = [str(v) for v in rng.sample(range(10_000, 100_000), self.num_chains)]
        statements = []
        for c in range(self.num_chains):
            chain = names[c * (self.num_hops + 1) : (c + 1) * (self.num_hops + 1)]
            start = depth / 100 if c == 0 else rng.random()
            fractions = [start] + sorted(start + (1 - start) * rng.random() for _ in range(self.num_hops))
            statements.append((fractions[0], f"VAR {chain[0]} = {values[c]}."))
            for hop in range(self.num_hops):
                statements.append((fractions[hop + 1], f"VAR {chain[hop + 1]} = VAR {chain[hop]}."))
        answers = tuple(names[: self.num_hops + 1])
        wording = vt_wording(self.template, values[0], self.num_hops + 1)
        return Layout.inserted(wording.head, hs.noise_haystack(), statements, wording.tail, answers, depth)


def read(prompt: Prompt) -> str | None:
    """Follow the assignments from the queried value, in text order."""
    question = question_in(prompt, _QUESTION)
    if question is None:
        return None
    holding = []
    for name, source in re.findall(r"VAR ([A-Z]+) = (\d+|VAR [A-Z]+)\.", prompt):
        if source == question.group(1) or source.removeprefix("VAR ") in holding:
            holding.append(name)
    return " ".join(holding)


TASKS = (VariableTracking(),)
