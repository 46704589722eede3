"""Haystack text of any length, and needle insertion at sentence boundaries.

A haystack is an endless text read by prefix: the bundled public-domain corpus (or a user file)
cycled, RULER-style repeated noise sentences, or sentences drawn from a seeded generator.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path

DEFAULT_CORPUS = "kjv_genesis_exodus.jsonl"
NOISE = "The grass is green. The sky is blue. The sea is calm. The road goes on. Here we go again. "
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")
# a sentence boundary is looked for this far back from the requested position
_BOUNDARY_WINDOW = 4096


def corpus_path(name: str = DEFAULT_CORPUS) -> Path:
    path = resources.files("k3ray.evals") / "data" / name
    return Path(str(path))


@functools.lru_cache(maxsize=8)
def load_corpus(path: str | None = None) -> str:
    """The documents of a JSONL (`text` field) or `.txt` file, read through `datasets`, joined."""
    # lazy: datasets (the eval extra, seconds to import) only when a haystack is read
    import datasets

    path = str(corpus_path() if path is None else path)
    if not Path(path).is_file():
        raise ValueError(f"haystack file {path!r} does not exist")
    if path.endswith(".txt"):
        rows = datasets.load_dataset("text", data_files=path, split="train", sample_by="paragraph")
        sep = "\n\n"
    else:
        rows = datasets.load_dataset("json", data_files=path, split="train")
        sep = " "
        if "text" not in rows.column_names:
            raise ValueError(f"haystack file {path!r} has no 'text' field (columns: {rows.column_names})")
    text = sep.join(t.strip() for t in rows["text"] if t and t.strip())
    if not text:
        raise ValueError(f"haystack file {path!r} holds no text")
    return text + sep


class CycledText:
    """`prefix(n)`: the first n characters of `unit` repeated forever."""

    def __init__(self, unit: str) -> None:
        assert unit, "empty haystack unit"
        self.unit = unit

    def prefix(self, n: int) -> str:
        reps = n // len(self.unit) + 1
        return (self.unit * reps)[:n]


class StreamedText:
    """`prefix(n)` over the concatenation of pieces drawn from a generator, extended on demand."""

    def __init__(self, pieces: Iterator[str]) -> None:
        self._pieces = pieces
        self._chunks: list[str] = []
        self._size = 0
        self._text = ""

    def prefix(self, n: int) -> str:
        if n > len(self._text):
            while self._size < n:
                piece = next(self._pieces)
                self._chunks.append(piece)
                self._size += len(piece)
            self._text = "".join(self._chunks)
        return self._text[:n]


def essay_haystack(path: str | None = None) -> CycledText:
    return CycledText(load_corpus(path))


def noise_haystack() -> CycledText:
    return CycledText(NOISE)


def generated_haystack(make_piece: Callable[[], str]) -> StreamedText:
    def pieces() -> Iterator[str]:
        while True:
            yield make_piece()

    return StreamedText(pieces())


def sentence_start_at_or_before(text: str, pos: int) -> int:
    """The start of the sentence holding `pos` (0 when none ends before it); `len(text)` stays the end."""
    if pos >= len(text):
        return len(text)
    while pos > 0:
        window_start = max(0, pos - _BOUNDARY_WINDOW)
        last = None
        for match in _SENTENCE_END.finditer(text, window_start, pos):
            last = match.end()
        if last is not None:
            return last
        pos = window_start
    return 0


def insert_at_depths(text: str, insertions: Sequence[tuple[float, str]]) -> str:
    """Insert each sentence at the sentence boundary at or before `fraction * len(text)`.

    Sentences given for the same boundary keep their order; fraction 1.0 appends at the end.
    Each insertion adds its length plus one space wherever it lands, so the size is predictable.
    """
    placed = []
    for order, (fraction, sentence) in enumerate(insertions):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"depth fraction must be in [0, 1], got {fraction}")
        placed.append((sentence_start_at_or_before(text, round(fraction * len(text))), order, sentence))
    placed.sort()
    out, cursor = [], 0
    for pos, _, sentence in placed:
        out.append(text[cursor:pos])
        cursor = pos
        if pos == len(text):
            out.append(" " + sentence)
        else:
            out.append(sentence + " ")
    out.append(text[cursor:])
    return "".join(out)
