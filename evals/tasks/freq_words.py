"""RULER-style frequent-words extraction (fwe): the three most frequent coded words in a text.

Coded words (random lowercase strings) appear with Zipf counts (rank r about r^-alpha), shuffled;
a tail of dots, which the prompt says to ignore, fills the text to the exact token length. The head
and question are the task's `template` (templates.py: "k3ray", or RULER's own "ruler").
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from k3ray.evals import haystack as hs
from k3ray.evals import words
from k3ray.evals.target import Prompt
from k3ray.evals.tasks.base import Cell, Layout, TextTask, fit_counted_core, question_in
from k3ray.evals.tasks.templates import DEFAULT_TEMPLATE, FWE_HEADS, fwe_wording

# k3ray's question, then RULER's (which says "three")
_QUESTION = re.compile(r"What are the (\d+|three) most (?:frequent coded words in the text above|frequently "
                       r"appeared words in the above coded text)\?")


@dataclass(frozen=True)
class FrequentWords(TextTask):
    name: str = "fwe"
    alpha: float = 2.0
    num_answers: int = 3
    max_tokens: int = 50
    template: str = DEFAULT_TEMPLATE
    uses_depth = False

    def __post_init__(self) -> None:
        fwe_wording(self.template, self.num_answers)  # a ValueError names a wrong template or count

    def _core(self, rng: random.Random, num_words: int, length: int) -> tuple[list[str], list[str]]:
        if num_words <= 0:  # the template alone fills the length
            raise ValueError(f"length {length} is too short for frequent-words extraction ({num_words} words)")
        harmonic = sum(r**-self.alpha for r in range(1, 10_000))
        vocab_size = max(self.num_answers + 1, int((num_words / harmonic) ** (1 / self.alpha)))
        counts = [int(num_words * r**-self.alpha / harmonic) for r in range(1, vocab_size + 1)]
        top = counts[: self.num_answers + 1]
        if any(a <= b for a, b in zip(top, top[1:], strict=False)):
            raise ValueError(f"length {length} is too short for frequent-words extraction ({num_words} words)")
        vocab = words.coded_words(rng, vocab_size)
        text = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        rng.shuffle(text)
        return vocab[: self.num_answers], text

    def layout(self, rng: random.Random, cell: Cell, count: Callable[[str], int], budget: int) -> Layout:
        wording = fwe_wording(self.template, self.num_answers)
        head, tail = wording.head, wording.tail
        per_word = count(" ".join(words.coded_words(random.Random(0), 64))) / 64
        core_seed = rng.getrandbits(64)

        def build(num_words: int) -> tuple[list[str], str]:
            answers, text = self._core(random.Random(core_seed), num_words, cell.length)
            return answers, head + " ".join(text)

        answers, core = fit_counted_core(build, count, head, tail, per_word, budget, "a coded text")
        return Layout.filled(core, hs.CycledText(" ...."), tail, tuple(answers))


def read(prompt: Prompt) -> str | None:
    """Count the coded words (dots ignored) and name the most frequent ones."""
    question = question_in(prompt, _QUESTION)
    if question is None:
        return None
    start = max((prompt.find(head) + len(head) for head in FWE_HEADS if head in prompt), default=0)
    body = prompt[start : prompt.rindex("\nQuestion:", 0, question.start())]  # RULER's asks to ignore "the dots"
    counts = Counter(w for w in body.split() if w.isalpha() and w.islower())
    wanted = 3 if question.group(1) == "three" else int(question.group(1))
    return ", ".join(word for word, _ in counts.most_common(wanted))


TASKS = (FrequentWords(),)
