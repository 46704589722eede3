"""Which checkpoint a model argument names (`checkpoint_dir`): a directory, a shipped checkpoint's
name, or none for the embedded default: a deterministic tiny K3 checkpoint written on first use to
a cache dir.

Same format as the published K3 checkpoint (sharded safetensors, MXFP4 experts, config.json)
plus the byte-level tokenizer's config (with K3's special tokens and XTML chat format), so every code path that loads K3 loads it too."""

from __future__ import annotations

import os
import shutil
import tempfile

from k3ray.checkpoints import resolve_shipped
from k3ray.config import k3_tiny_config

DEFAULT_NAME = "k3-tiny-v5"  # bump when the tiny model's definition (its tokenizer files too) changes
DEFAULT_SEED = 0


def cache_root() -> str:
    return os.environ.get("K3RAY_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "k3ray")


def write_tiny_checkpoint(path: str, seed: int = DEFAULT_SEED, max_shard_bytes: int = 256 * 1024) -> str:
    """Write the tiny K3 (random weights from `seed`, bf16 + published fp32 exceptions) with its
    vision tower and projector to path."""
    # lazy: torch and the model stack only to write it; resolving a model argument (serve's preflight) stays torch-free
    import torch

    from k3ray.models.init import build_model
    from k3ray.tokenizer.byte import ByteTokenizer
    from k3ray.tokenizer.chat_format import KIMI_K3_XTML
    from k3ray.vision.model import build_vision_model
    from k3ray.weights.writer import save_checkpoint

    config = k3_tiny_config()
    model = build_model(config, torch.bfloat16, seed=seed)
    vision = build_vision_model(config.vision, torch.bfloat16, seed=seed)
    save_checkpoint(model, path, max_shard_bytes=max_shard_bytes, vision=vision)
    ByteTokenizer(vocab_size=config.vocab_size, chat_format=KIMI_K3_XTML).save_pretrained(path)  # K3's own chat format
    return path


def default_checkpoint_dir() -> str:
    """The default checkpoint directory, created atomically on first use."""
    final = os.path.join(cache_root(), DEFAULT_NAME)
    if os.path.exists(os.path.join(final, "config.json")):
        return final
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=cache_root())
    try:
        write_tiny_checkpoint(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def checkpoint_dir(model: str | os.PathLike | None) -> str:
    """The directory to load: None, or DEFAULT_NAME where no checkpoint of that name is here -> the
    default tiny checkpoint (written on first use); a shipped name that is not an existing path ->
    its packaged directory; anything else as given."""
    if model is None or (os.fspath(model) == DEFAULT_NAME and not os.path.exists(os.path.join(model, "config.json"))):
        return default_checkpoint_dir()
    return resolve_shipped(model)
