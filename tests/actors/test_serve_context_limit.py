"""A max_model_len that the cache, not the model, sets is said at start (K3Server logs it as a warning):
both numbers and the flags that raise it, with the cache size that holds the model's whole context."""

import re

import pytest

from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import build_engine, context_limit_note
from k3ray.default_model import checkpoint_dir
from k3ray.engine.process.engine_info import EngineInfo

POSITIONS = 1_048_576  # the tiny checkpoints' max_position_embeddings, as K3's


def started(model: str, **engine) -> tuple[ServeArgs, EngineInfo]:
    args = ServeArgs.model_validate({"model": {"model": model}, "engine": engine}).resolved()
    return args, EngineInfo.of(build_engine(args)[0])


@pytest.mark.parametrize("name, capped", [(None, 847_560), ("k3-tiny-niah", 234_105)], ids=["default", "niah"])
def test_a_cache_capped_context_is_said_with_the_flag_that_raises_it(name, capped):
    args, info = started(checkpoint_dir(name))
    note = context_limit_note(args, info)
    assert info.max_model_len == capped and note is not None
    assert f"max_model_len is {capped} tokens, below the model's {POSITIONS}" in note
    (mb,) = re.findall(r"--cache-memory-mb (\d+) \(now 256\) raises it to 1048576", note)
    assert "--max-num-seqs" in note and "--max-model-len only lowers it" in note
    if name is None:  # the suggested cache does hold the whole context, one MB less does not
        assert started(args.model.model, cache_memory_mb=int(mb))[1].max_model_len == POSITIONS
        assert started(args.model.model, cache_memory_mb=int(mb) - 1)[1].max_model_len < POSITIONS


def test_no_note_when_the_model_or_the_flag_sets_it():
    model = checkpoint_dir(None)
    assert context_limit_note(*started(model, max_model_len=4096)) is None
    assert context_limit_note(*started(model, cache_memory_mb=320)) is None
