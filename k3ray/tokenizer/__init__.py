"""Tokenizers for K3: the tiktoken BPE of the published checkpoint and a byte-level one for k3-tiny.

Everything else in k3ray talks to the `Tokenizer` interface (encode / decode / chat template /
special ids) and streams text with `IncrementalDetokenizer`.
"""

from k3ray.tokenizer.base import Tokenizer
from k3ray.tokenizer.byte import ByteTokenizer
from k3ray.tokenizer.chat import DEFAULT_SYSTEM_PROMPT, ChatSegment, MediaItem, collect_media, render_chat
from k3ray.tokenizer.detok import IncrementalDetokenizer, stop_prefix_len, truncate_at_stop
from k3ray.tokenizer.load import load_tokenizer
from k3ray.tokenizer.tiktoken_bpe import KIMI_PAT_STR, TiktokenTokenizer

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "KIMI_PAT_STR",
    "ByteTokenizer",
    "ChatSegment",
    "IncrementalDetokenizer",
    "MediaItem",
    "TiktokenTokenizer",
    "Tokenizer",
    "collect_media",
    "load_tokenizer",
    "render_chat",
    "stop_prefix_len",
    "truncate_at_stop",
]
