"""RULER-style common-words extraction (cwe): find the words a long numbered list repeats most.

Ten words appear `freq_common` times each (30, fewer for short lengths), the rest `freq_uncommon`
times (3), shuffled. A tail of made-up words that appear once fills the list to the exact token
length without changing the answer. The head, question and list layout are the task's `template`
(templates.py: "k3ray", one item a line, or RULER's own "ruler", "1. apple 2. pear").
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from k3ray.evals import haystack as hs
from k3ray.evals import words
from k3ray.evals.target import Prompt
from k3ray.evals.tasks.base import Cell, Layout, TextTask, counted_core_min_budget, fit_counted_core, question_in
from k3ray.evals.tasks.templates import CWE_ITEM_SEPARATOR, DEFAULT_TEMPLATE, check_template, cwe_wording

# k3ray's question, then RULER's
_QUESTION = re.compile(r"What are the (\d+) most common words in the (?:list above|above list)\?")
_ITEM = re.compile(r"(?:^|\s)\d+\. ([^\s\d]\S*)(?=\s|$)")


@dataclass(frozen=True)
class CommonWords(TextTask):
    name: str = "cwe"
    num_common: int = 10
    freq_common: int = 30
    freq_uncommon: int = 3
    max_tokens: int = 120
    template: str = DEFAULT_TEMPLATE
    uses_depth = False

    def __post_init__(self) -> None:
        cwe_wording(self.template, self.num_common)  # a ValueError names a wrong template or count

    @property
    def min_items(self) -> int:
        """The shortest list whose common words appear at least freq_uncommon + 2 times each."""
        return 2 * self.num_common * (self.freq_uncommon + 2)

    def _core(self, rng: random.Random, num_items: int, length: int) -> tuple[list[str], list[str]]:
        freq = min(self.freq_common, num_items // (2 * self.num_common))
        if freq <= self.freq_uncommon + 1:
            raise ValueError(f"length {length} is too short for common-words extraction (room for {num_items} items)")
        num_uncommon = (num_items - self.num_common * freq) // self.freq_uncommon
        vocab = words.distinct_words(rng, self.num_common + num_uncommon)
        common = vocab[: self.num_common]
        listed = common * freq + vocab[self.num_common :] * self.freq_uncommon
        rng.shuffle(listed)
        return common, listed

    def _head_tail(self) -> tuple[str, str]:
        wording = cwe_wording(self.template, self.num_common)
        return wording.head, wording.tail

    def _tokens_per_item(self, count: Callable[[str], int]) -> float:
        sep = CWE_ITEM_SEPARATOR[self.template]
        sample = "".join(f"{sep}{1000 + i}. {w}" for i, w in enumerate(words.distinct_words(random.Random(0), 64)))
        return count(sample) / 64

    def min_prompt_tokens(self, count: Callable[[str], int]) -> int:
        return counted_core_min_budget(count, *self._head_tail(), self._tokens_per_item(count), self.min_items)

    def layout(self, rng: random.Random, cell: Cell, count: Callable[[str], int], budget: int) -> Layout:
        head, tail = self._head_tail()
        sep = CWE_ITEM_SEPARATOR[self.template]
        core_seed, tail_seed = rng.getrandbits(64), rng.getrandbits(64)

        def build(num_items: int) -> tuple[tuple[list[str], list[str]], str]:
            common, listed = self._core(random.Random(core_seed), num_items, cell.length)
            items = sep.join(f"{i}. {w}" for i, w in enumerate(listed, 1))
            return (common, listed), head.rstrip("\n") + "\n" + items

        (common, listed), core = fit_counted_core(build, count, head, tail, self._tokens_per_item(count), budget,
                                                  "a common-words list")
        filler = hs.StreamedText(_once_only_items(random.Random(tail_seed), len(listed) + 1, sep))
        return Layout.filled(core, filler, tail, tuple(common))


def _once_only_items(rng: random.Random, start: int, sep: str) -> Iterator[str]:
    index = start
    while True:
        # four syllables: never one of the listed (real or three-syllable) words
        yield f"{sep}{index}. {words.made_up_word(rng, 4)}"
        index += 1


def read(prompt: Prompt) -> str | None:
    """Count the listed words and name the most frequent ones."""
    question = question_in(prompt, _QUESTION)
    if question is None:
        return None
    counts = Counter(_ITEM.findall(prompt[: question.start()]))
    return ", ".join(word for word, _ in counts.most_common(int(question.group(1))))


TASKS = (CommonWords(),)
