"""The tokenizer interface the rest of k3ray uses, with the logic every byte-level vocabulary shares.

A vocabulary has two kinds of ids below `vocab_size`: base ids `[0, num_base_tokens)` that stand
for byte strings, and special tokens (`special_tokens`) at and above `num_base_tokens`. As in Kimi's
`tokenization_kimi.py`, a special slot the vocabulary does not name is the special token
`<|reserved_token_{id}|>`: it decodes to that text (or to nothing with skip_special_tokens), and the
Hugging Face files list it, so both tokenizers know every id.
"""

from __future__ import annotations

import operator
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

from k3ray.tokenizer import special as sp
from k3ray.tokenizer.chat import ChatSegment
from k3ray.tokenizer.chat_format import encode_segments, pick_format, render_segments
from k3ray.tokenizer.chat_options import ChatOptions


class Tokenizer(ABC):
    """Encode / decode / chat-template interface shared by ByteTokenizer and TiktokenTokenizer."""

    def __init__(
        self,
        *,
        name: str,
        vocab_size: int,
        num_base_tokens: int,
        special_tokens: dict[str, int],
        bos_token: str,
        eos_token: str,
        pad_token: str,
        chat_template: str | None = None,
        chat_format: str | None = None,
    ) -> None:
        """chat_format: the format k3ray's own files declare; else a chat_template makes it `jinja`,
        and the vocabulary's markers pick K3's XTML or K2's (chat_format.pick_format)."""
        assert 256 <= num_base_tokens <= vocab_size, (num_base_tokens, vocab_size)
        for token, token_id in special_tokens.items():
            if not num_base_tokens <= token_id < vocab_size:
                raise ValueError(
                    f"special token {token!r} has id {token_id}, outside [{num_base_tokens}, {vocab_size})"
                )
        if len(set(special_tokens.values())) != len(special_tokens):
            raise ValueError("two special tokens share one id")
        special_tokens = with_reserved_tokens(special_tokens, num_base_tokens, vocab_size)
        self.name = name
        self.vocab_size = vocab_size
        self.num_base_tokens = num_base_tokens
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.chat_format = pick_format(special_tokens, chat_template, chat_format)
        self._special_by_id = {token_id: token for token, token_id in special_tokens.items()}
        self.bos_token_id = self._named_special(bos_token, "bos_token")
        self.eos_token_id = self._named_special(eos_token, "eos_token")
        self.pad_token_id = self._named_special(pad_token, "pad_token")
        end_of_turn = {special_tokens[t] for t in sp.END_OF_TURN_TOKENS if t in special_tokens}
        self.stop_token_ids = frozenset({self.eos_token_id} | end_of_turn)
        # longest first, so a special that is a prefix of another never wins
        by_length = sorted(special_tokens, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self.media_begin_token = sp.MEDIA_BEGIN if sp.MEDIA_BEGIN in special_tokens else sp.MEDIA_START
        has_pad_only = sp.MEDIA_PAD in special_tokens and sp.KIMI_IMAGE_PLACEHOLDER not in special_tokens
        self.media_placeholder_token = sp.MEDIA_PAD if has_pad_only else sp.KIMI_IMAGE_PLACEHOLDER

    # -- what a concrete vocabulary provides ------------------------------------------------------
    @abstractmethod
    def _encode_ordinary(self, text: str) -> list[int]:
        """Base ids for text, with no special-token parsing."""

    @abstractmethod
    def _base_token_bytes(self, token_id: int) -> bytes:
        """The bytes of a base id (0 <= token_id < num_base_tokens)."""

    @abstractmethod
    def save_pretrained(self, directory: str | Path) -> None:
        """Write the files `load_tokenizer(directory)` reads back."""

    # -- encode / decode --------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids for text; special-token strings become special ids only with allow_special=True."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not allow_special or self._special_pattern is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > start:
                ids += self._encode_ordinary(text[start : match.start()])
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._encode_ordinary(text[start:])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ids. Invalid UTF-8 becomes U+FFFD; a special token ends any pending byte sequence."""
        parts: list[str] = []
        pending = bytearray()
        for token_id in ids:
            piece = self.token_piece(token_id)
            if isinstance(piece, bytes):
                pending += piece
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if not (skip_special_tokens and self.is_special(token_id)):
                parts.append(piece)
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_piece(self, token_id: int) -> bytes | str:
        """Bytes for a base id, the token string for a special (or reserved) id."""
        token_id = self._checked_id(token_id)
        if token_id < self.num_base_tokens:
            return self._base_token_bytes(token_id)
        return self._special_by_id[token_id]

    def is_special(self, token_id: int) -> bool:
        """Whether token_id is a special token (every id from num_base_tokens up is one)."""
        return self._checked_id(token_id) >= self.num_base_tokens

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Readable pieces: a base token's text with undecodable bytes as `<0xAB>`, specials by name."""
        pieces = []
        for token_id in ids:
            piece = self.token_piece(token_id)
            pieces.append(_readable_bytes(piece) if isinstance(piece, bytes) else piece)
        return pieces

    # -- chat -------------------------------------------------------------------------------------
    def chat_segments(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[dict] | None = None,
        options: ChatOptions | None = None,
    ) -> list[ChatSegment]:
        """The rendered conversation as control / text segments in this tokenizer's chat format."""
        return render_segments(self, messages, add_generation_prompt, continue_final_message, tools,
                               options or ChatOptions())

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[dict] | None = None,
        options: ChatOptions | None = None,
    ) -> str:
        """The prompt string for a conversation (encode it with allow_special=True)."""
        segments = self.chat_segments(messages, add_generation_prompt, continue_final_message, tools, options)
        return "".join(segment.text for segment in segments)

    def encode_chat(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[dict] | None = None,
        options: ChatOptions | None = None,
    ) -> list[int]:
        """Prompt ids where only the template's markup becomes special tokens, never message text."""
        return encode_segments(self, self.chat_segments(messages, add_generation_prompt, continue_final_message,
                                                        tools, options))

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def media_placeholder_token_id(self) -> int | None:
        return self.special_tokens.get(self.media_placeholder_token)

    def _named_special(self, token: str, field: str) -> int:
        if token not in self.special_tokens:
            raise ValueError(f"{field} {token!r} is not one of the special tokens")
        return self.special_tokens[token]

    def _checked_id(self, token_id: int) -> int:
        try:
            token_id = operator.index(token_id)
        except TypeError:
            raise ValueError(f"token id must be an integer, got {token_id!r}") from None
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return token_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


def with_reserved_tokens(named: dict[str, int], num_base_tokens: int, vocab_size: int) -> dict[str, int]:
    """`named` plus `<|reserved_token_{id}|>` for each special slot it leaves unnamed."""
    taken = set(named.values())
    out = dict(named)
    for token_id in range(num_base_tokens, vocab_size):
        if token_id in taken:
            continue
        name = sp.reserved_token(token_id)
        if name in out:
            raise ValueError(f"special token {name!r} has id {out[name]}, but that name is reserved for id {token_id}")
        out[name] = token_id
    return out


def _readable_bytes(piece: bytes) -> str:
    text = piece.decode("utf-8", errors="surrogateescape")
    return "".join(f"<0x{ord(c) - 0xDC00:02X}>" if "\udc80" <= c <= "\udcff" else c for c in text)
