"""K3's own tokenizer: a tiktoken BPE (`tiktoken.model`) plus an HF-style `tokenizer_config.json`.

Special tokens come from `added_tokens_decoder` at their published ids (K3: `[BOS]` 163584,
EOS 163586, pad 163839, the media placeholder 163605); the vocabulary is the base ranks plus
256 special / reserved slots (163584 + 256 = 163840 for K3). Pre-tokenization uses the regex of
Kimi's `tokenization_kimi.py` (`pat_str`), and long inputs are cut the way that file cuts them
(400k-character windows, runs of one whitespace class at most 25k characters) so ids match it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import tiktoken

from k3ray.tokenizer import special as sp
from k3ray.tokenizer.base import Tokenizer
from k3ray.tokenizer.files import read_bpe_ranks, read_json, write_bpe_ranks, write_json

MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
NUM_RESERVED_SPECIAL_TOKENS = 256
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# Kimi's pre-tokenizer: Han runs, cased-letter words with English contractions, 1-3 digit groups,
# punctuation runs, newlines, whitespace. `&&` is a character-class intersection (Rust regex syntax).
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# a maximal run (the lookbehind keeps the scan linear) longer than MAX_RUN_CHARS
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}|(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}")


class TiktokenTokenizer(Tokenizer):
    """Kimi-style tiktoken BPE with HF `tokenizer_config.json` special tokens."""

    def __init__(self, mergeable_ranks: dict[bytes, int], config: dict, name: str = "tiktoken") -> None:
        num_base_tokens = len(mergeable_ranks)
        if sorted(mergeable_ranks.values()) != list(range(num_base_tokens)):
            raise ValueError(f"BPE ranks must be exactly 0..{num_base_tokens - 1}, each once")
        missing = [b for b in range(256) if bytes([b]) not in mergeable_ranks]
        if missing:
            raise ValueError(f"BPE ranks lack {len(missing)} single bytes, e.g. {bytes(missing[:4])!r}")
        special_tokens = added_tokens(config)
        vocab_size = max([num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS, *(i + 1 for i in special_tokens.values())])
        pad_default = sp.PAD if sp.PAD in special_tokens else _token_content(config.get("eos_token"), sp.EOS)
        template = config.get("chat_template")
        super().__init__(
            name=name,
            vocab_size=vocab_size,
            num_base_tokens=num_base_tokens,
            special_tokens=special_tokens,
            bos_token=_token_content(config.get("bos_token"), sp.BOS),
            eos_token=_token_content(config.get("eos_token"), sp.EOS),
            pad_token=_token_content(config.get("pad_token"), pad_default),
            chat_template=template if isinstance(template, str) else None,
        )
        self.config = dict(config)
        self._mergeable_ranks = dict(mergeable_ranks)
        self._token_bytes = sorted(mergeable_ranks, key=mergeable_ranks.__getitem__)
        # special tokens are parsed by Tokenizer.encode, so tiktoken only ever sees ordinary text
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=KIMI_PAT_STR, mergeable_ranks=self._mergeable_ranks, special_tokens={}
        )

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> TiktokenTokenizer:
        directory = Path(directory)
        ranks = read_bpe_ranks(directory / MODEL_FILE)
        config = read_json(directory / CONFIG_FILE)
        return cls(ranks, config, name=directory.resolve().name or "tiktoken")

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_bpe_ranks(directory / MODEL_FILE, self._mergeable_ranks)
        write_json(directory / CONFIG_FILE, self.config)

    def _encode_ordinary(self, text: str) -> list[int]:
        if len(text) <= MAX_RUN_CHARS:
            return self._encoding.encode_ordinary(text)
        ids: list[int] = []
        for chunk in split_for_tiktoken(text):
            ids += self._encoding.encode_ordinary(chunk)
        return ids

    def _base_token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]


def added_tokens(config: dict) -> dict[str, int]:
    """Special-token string -> id from an HF `added_tokens_decoder` ({"163584": {"content": "[BOS]"}, ...})."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict) or not decoder:
        raise ValueError(f"{CONFIG_FILE} needs a non-empty added_tokens_decoder object")
    tokens: dict[str, int] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (str(key).isascii() and str(key).isdigit()) or not isinstance(content, str) or not content:
            raise ValueError(f"added_tokens_decoder entry {key!r}: expected a numeric id and a 'content' string")
        if content in tokens:
            raise ValueError(f"added_tokens_decoder names {content!r} twice (ids {tokens[content]} and {key})")
        tokens[content] = int(key)
    return tokens


def split_for_tiktoken(text: str) -> Iterator[str]:
    """Pieces of text no longer than MAX_ENCODE_CHARS, with no run of one whitespace class over MAX_RUN_CHARS."""
    for window_start in range(0, len(text), MAX_ENCODE_CHARS):
        window = text[window_start : window_start + MAX_ENCODE_CHARS]
        start = 0
        for run in _LONG_RUN.finditer(window):
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield window[start:cut]
                start = cut
        yield window[start:]


def _token_content(value: object, default: str) -> str:
    """An HF token field: a plain string, an AddedToken dict ({"content": ...}) or absent."""
    if value is None:
        return default
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{CONFIG_FILE} token field must be a string or {{'content': str}}, got {value!r}")
    return value
