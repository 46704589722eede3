"""Streaming detokenization and stop strings.

`IncrementalDetokenizer` turns ids into text one at a time, holding back the bytes of a UTF-8
character a byte-level token split until the character is complete, so a stream never shows a
replacement character for a sequence that is merely incomplete. The concatenation of everything it
returns (after `flush`) equals `tokenizer.decode(ids)` for any ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from k3ray.tokenizer.base import Tokenizer


class IncrementalDetokenizer:
    """Feed ids with `push`; each call returns only the new, complete text. Call `flush` at the end."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chunks: list[str] = []

    def push(self, token_id: int) -> str:
        piece = self.tokenizer.token_piece(token_id)
        if isinstance(piece, bytes):
            new = self._decoder.decode(piece)
        else:
            # a special token ends the byte stream: an unfinished character can no longer complete
            new = self._end_bytes()
            if not (self.skip_special_tokens and self.tokenizer.is_special(token_id)):
                new += piece
        if new:
            self._chunks.append(new)
        return new

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(token_id) for token_id in ids)

    def flush(self) -> str:
        """Text still held back (a dangling partial character becomes U+FFFD), then start afresh."""
        new = self._end_bytes()
        if new:
            self._chunks.append(new)
        return new

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._chunks)

    @property
    def has_pending_bytes(self) -> bool:
        return bool(self._decoder.getstate()[0])

    def _end_bytes(self) -> str:
        new = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return new


def truncate_at_stop(text: str, stop: str | Sequence[str] | None, search_from: int = 0) -> tuple[str, str | None]:
    """Cut text before the earliest stop string: (text[:start], matched stop), or (text, None).

    Only matches ending after index `search_from` are looked for, so a caller that checked the text
    up to that length before can pass it and skip re-scanning. At equal starts the longer stop wins.
    """
    stops = _checked_stops(stop)
    best_start, best_stop = len(text) + 1, None
    for candidate in stops:
        start = text.find(candidate, max(0, search_from - len(candidate) + 1))
        if start != -1 and (start < best_start or (start == best_start and len(candidate) > len(best_stop))):
            best_start, best_stop = start, candidate
    if best_stop is None:
        return text, None
    return text[:best_start], best_stop


def stop_prefix_len(text: str, stop: str | Sequence[str] | None) -> int:
    """Length of the longest suffix of text that could still grow into a stop string.

    A stream should hold back that many trailing characters so it never shows the start of a stop.
    """
    longest = 0
    for candidate in _checked_stops(stop):
        for length in range(min(len(candidate) - 1, len(text)), longest, -1):
            if text.endswith(candidate[:length]):
                longest = length
                break
    return longest


def _checked_stops(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for candidate in stops:
        if not isinstance(candidate, str) or not candidate:
            raise ValueError(f"stop strings must be non-empty strings, got {candidate!r}")
    return stops
