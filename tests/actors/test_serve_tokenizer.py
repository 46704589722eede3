"""`k3ray serve --tokenizer DIR` (model.tokenizer): a checkpoint folder without tokenizer files is
served with a tokenizer named elsewhere, and refused clearly without one."""

import shutil
from pathlib import Path

import pytest

from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import build_engine


@pytest.fixture(scope="module")
def bare_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint's config and weights, no tokenizer files."""
    bare = tmp_path_factory.mktemp("bare")
    for path in Path(tiny_checkpoint).iterdir():
        if not path.name.startswith("tokenizer"):
            shutil.copy(path, bare)
    return bare


def engine_args(model, tokenizer=None) -> ServeArgs:
    return ServeArgs.model_validate({"model": {"model": str(model), "tokenizer": tokenizer},
                                     "engine": {"max_model_len": 64, "cache_memory_mb": 8}}).resolved()


def test_a_tokenizer_named_elsewhere_serves_a_bare_checkpoint(bare_checkpoint, tiny_checkpoint):
    engine, _ = build_engine(engine_args(bare_checkpoint, tiny_checkpoint))
    assert engine.tokenizer.vocab_size == 512 and engine.tokenizer.chat_format == "kimi_k3_xtml"
    with pytest.raises(ValueError, match="no tokenizer in"):
        build_engine(engine_args(bare_checkpoint))
