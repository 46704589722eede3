"""Oracle targets that check the harness without a model: one always right, one always wrong.

The right one answers like a perfect reader: each task ships a reader that finds the answer in
the prompt itself (the needles, the assignment chain, the word counts, the card in the images),
so a 100% score also proves every generated prompt holds its answer. The wrong one gives the same
answer with every digit and letter changed, which must score 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from k3ray.evals.target import Prompt, chat_text
from k3ray.evals.tasks import READERS
from k3ray.tokenizer import ByteTokenizer

_DIGITS = str.maketrans("0123456789", "5678901234")


def default_tokenizer():
    return ByteTokenizer()


def _rot13(text: str) -> str:
    return re.sub(
        r"[A-Za-z]",
        lambda m: chr((ord(m.group()) - (base := 65 if m.group() < "a" else 97) + 13) % 26 + base),
        text,
    )


def corrupt(answer: str) -> str:
    """The same answer with every digit shifted by five and every letter rotated by 13."""
    wrong = _rot13(answer.translate(_DIGITS))
    for part in re.split(r"[,\s]+", answer):
        assert not part or part.lower() not in wrong.lower(), f"corrupted answer {wrong!r} still holds {part!r}"
    return wrong


class OracleTarget:
    """A `Target` that reads each prompt's answer; `wrong=True` makes every answer wrong."""

    def __init__(
        self,
        *,
        wrong: bool = False,
        tokenizer=None,
        readers: Sequence[Callable[[Prompt], str | None]] | None = None,
        max_context: int | None = None,
        name: str | None = None,
    ) -> None:
        self.wrong = wrong
        self.tokenizer = default_tokenizer() if tokenizer is None else tokenizer
        self.readers = tuple(READERS if readers is None else readers)
        self.max_context = max_context
        self.name = name or ("oracle-wrong" if wrong else "oracle-right")

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def count_chat_tokens(self, messages: list[dict[str, Any]]) -> int | None:
        """A text chat's tokens through the tokenizer's chat template; None for media (not counted here)."""
        if chat_text(messages) is None:
            return None
        return len(self.tokenizer.encode_chat(messages, add_generation_prompt=True))

    def read(self, prompt: Prompt) -> str:
        text = chat_text(prompt)  # a text task's prompt sent as chat reads as its text
        for reader in self.readers:
            answer = reader(prompt if text is None else text)
            if answer is not None:
                return answer
        raise ValueError("no task reader recognises this prompt")

    def complete(self, prompt: Prompt, max_tokens: int) -> str:
        answer = self.read(prompt)
        return " " + (corrupt(answer) if self.wrong else answer)
