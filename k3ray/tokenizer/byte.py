"""A byte-level tokenizer with Kimi's special tokens, for k3-tiny models and CPU tests.

Ids 0..255 are raw bytes, the specials start at 256 in the order of their chat format's list
(`SPECIAL_TOKENS`; both match `k3ray.config.k3_tiny_config`: BOS 256, EOS 257, media placeholder
266), `[PAD]` is the last id and every other id is reserved. `kimi_k3_xtml` has K3's XTML markers
and no Jinja template (as K3's release tokenizer); `kimi_k2` has K2's markers and writes its Jinja
template for Hugging Face clients. A saved file names its format (`k3ray_chat_format`); one that
names none is K2's (the shipped fixtures were trained in it) unless it carries a template of its own,
which is then rendered as a Jinja checkpoint's.
"""

from __future__ import annotations

from pathlib import Path

from k3ray.tokenizer import special as sp
from k3ray.tokenizer.base import Tokenizer
from k3ray.tokenizer.chat_format import JINJA, KIMI_K2, KIMI_K3_XTML
from k3ray.tokenizer.chat_jinja import chat_template as k2_chat_template
from k3ray.tokenizer.files import read_json

TOKENIZER_CLASS = "K3ByteTokenizer"
K3RAY_CLASS_KEY = "k3ray_tokenizer_class"  # tokenizer_class names the Hugging Face class
BYTE_SPECIAL_TOKENS_K2 = (
    sp.BOS,  # 256
    sp.EOS,  # 257
    sp.IM_END,  # 258
    sp.IM_USER,
    sp.IM_ASSISTANT,
    sp.IM_SYSTEM,
    sp.IM_MIDDLE,
    sp.MEDIA_START,  # 263
    sp.MEDIA_CONTENT,
    sp.MEDIA_END,
    sp.KIMI_IMAGE_PLACEHOLDER,  # 266
    sp.TOOL_CALLS_SECTION_BEGIN,  # 267
    sp.TOOL_CALLS_SECTION_END,
    sp.TOOL_CALL_BEGIN,
    sp.TOOL_CALL_ARGUMENT_BEGIN,
    sp.TOOL_CALL_END,  # 271
)
BYTE_SPECIAL_TOKENS_K3 = (  # K3's release order from [BOS], media tokens moved so the placeholder stays 266
    sp.BOS,  # 256
    sp.EOS,  # 257
    sp.END_OF_MSG,
    sp.OPEN,
    sp.CLOSE,
    sp.SEP,  # 261
    sp.MEDIA_BEGIN,
    sp.MEDIA_CONTENT,
    sp.MEDIA_END,
    "[EOT]",
    sp.MEDIA_PAD,  # 266
)
CHAT_FORMAT_KEY = "k3ray_chat_format"
SPECIAL_TOKENS = {KIMI_K2: BYTE_SPECIAL_TOKENS_K2, KIMI_K3_XTML: BYTE_SPECIAL_TOKENS_K3}
MIN_VOCAB_SIZE = 256 + max(map(len, SPECIAL_TOKENS.values())) + 1  # bytes, specials, [PAD]
DEFAULT_VOCAB_SIZE = 512
_SINGLE_BYTES = tuple(bytes([b]) for b in range(256))


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids, Kimi specials from id 256, `[PAD]` at vocab_size - 1."""

    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE, chat_format: str = KIMI_K2,
                 chat_template: str | None = None) -> None:
        """chat_format: kimi_k2 or kimi_k3_xtml (the vocabulary's markers), or jinja with the
        chat_template to render (over K2's vocabulary)."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE}, got {vocab_size!r}")
        if chat_format not in (*SPECIAL_TOKENS, JINJA) or (chat_format == JINJA) != (chat_template is not None):
            raise ValueError(f"chat_format must be one of {(*SPECIAL_TOKENS, JINJA)} (jinja with a chat_template), "
                             f"got {chat_format!r}")
        names = SPECIAL_TOKENS.get(chat_format, BYTE_SPECIAL_TOKENS_K2)  # a Jinja template over K2's vocabulary
        special_tokens = {token: 256 + i for i, token in enumerate(names)}
        special_tokens[sp.PAD] = vocab_size - 1
        super().__init__(
            name="k3-byte",
            vocab_size=vocab_size,
            num_base_tokens=256,
            special_tokens=special_tokens,
            bos_token=sp.BOS,
            eos_token=sp.EOS,
            pad_token=sp.PAD,
            chat_template=chat_template,
            chat_format=chat_format,
        )
        if chat_format == KIMI_K2:
            self.chat_template = k2_chat_template(self.media_begin_token, self.media_placeholder_token)

    def _encode_ordinary(self, text: str) -> list[int]:
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError:
            # lone surrogates become U+FFFD, as tiktoken does
            return list(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8"))

    def _base_token_bytes(self, token_id: int) -> bytes:
        return _SINGLE_BYTES[token_id]

    def save_pretrained(self, directory: str | Path) -> None:
        """tokenizer_config.json (which k3ray reads) and tokenizer.json: a Hugging Face fast tokenizer."""
        from k3ray.tokenizer.hf_files import save_hf_files  # lazy: `tokenizers` only to write tokenizer.json

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_hf_files(self, directory, {K3RAY_CLASS_KEY: TOKENIZER_CLASS, "vocab_size": self.vocab_size,
                                        CHAT_FORMAT_KEY: self.chat_format})

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ByteTokenizer:
        path = Path(directory) / "tokenizer_config.json"
        config = read_json(path)
        if saved_class(config) != TOKENIZER_CLASS:
            raise ValueError(f"{path} names tokenizer_class {saved_class(config)!r}, not {TOKENIZER_CLASS!r}")
        if "vocab_size" not in config:
            raise ValueError(f"{path} has no vocab_size")
        chat_format = config.get(CHAT_FORMAT_KEY)
        template = config.get("chat_template")
        if chat_format is None:  # written before formats were named: K2's, or a template someone put there
            own = k2_chat_template(sp.MEDIA_START, sp.KIMI_IMAGE_PLACEHOLDER)
            chat_format = JINJA if isinstance(template, str) and template != own else KIMI_K2
        return cls(config["vocab_size"], chat_format, template if chat_format == JINJA else None)


def saved_class(config: dict) -> str | None:
    """The k3ray class a tokenizer_config.json names (older files name it in tokenizer_class)."""
    return config.get(K3RAY_CLASS_KEY, config.get("tokenizer_class"))
