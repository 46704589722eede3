"""Pick the tokenizer a directory holds: K3's tiktoken files, or a saved ByteTokenizer."""

from __future__ import annotations

from pathlib import Path

from k3ray.tokenizer.base import Tokenizer
from k3ray.tokenizer.byte import TOKENIZER_CLASS as BYTE_TOKENIZER_CLASS
from k3ray.tokenizer.byte import ByteTokenizer, saved_class
from k3ray.tokenizer.files import read_json
from k3ray.tokenizer.tiktoken_bpe import CONFIG_FILE, MODEL_FILE, TiktokenTokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """`tiktoken.model` -> TiktokenTokenizer; `tokenizer_config.json` naming K3ByteTokenizer -> ByteTokenizer."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"tokenizer path {str(path)!r} is not a directory")
    if (directory / MODEL_FILE).is_file():
        return TiktokenTokenizer.from_pretrained(directory)
    config_path = directory / CONFIG_FILE
    found = "no tokenizer files"
    if config_path.is_file():
        tokenizer_class = saved_class(read_json(config_path))
        if tokenizer_class == BYTE_TOKENIZER_CLASS:
            return ByteTokenizer.from_pretrained(directory)
        found = f"{CONFIG_FILE} with tokenizer_class {tokenizer_class!r}"
    raise ValueError(
        f"no tokenizer in {str(directory)!r}: looked for {MODEL_FILE} (with {CONFIG_FILE}) or a {CONFIG_FILE} "
        f"whose tokenizer_class is {BYTE_TOKENIZER_CLASS!r}; found {found}"
    )


def tokenizer_for(checkpoint: str | Path | None, tokenizer=None) -> Tokenizer | None:
    """The tokenizer to use with a checkpoint: `tokenizer` itself if it is one, loaded from it if it
    is a directory (errors raise), else the checkpoint's own (None if it holds none)."""
    if isinstance(tokenizer, (str, Path)) or hasattr(tokenizer, "__fspath__"):
        return load_tokenizer(tokenizer)
    if tokenizer is not None or checkpoint is None:
        return tokenizer
    try:
        return load_tokenizer(checkpoint)
    except ValueError:
        return None
