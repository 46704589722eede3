"""Fixtures the engine tests share: the random k3-micro model and an LLM over it."""

import pytest

from k3ray.config import preset
from k3ray.engine import LLM
from k3ray.models.init import build_model
from k3ray.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def micro_model():
    return build_model(preset("k3-micro"), seed=0)


@pytest.fixture(scope="module")
def micro_llm(micro_model):
    """Byte tokenizer, 64 blocks of 8 tokens (max_model_len 512)."""
    return LLM(micro_model, ByteTokenizer(512), num_blocks=64, block_size=8)
