"""What a server needs to know about an engine it does not hold (EngineClient's engine lives in
another process): limits for request checks and the media setup."""

from __future__ import annotations

from dataclasses import dataclass

from k3ray.config import ModelConfig
from k3ray.engine.config import MultiModalConfig


@dataclass(frozen=True)
class EngineInfo:
    max_model_len: int
    vocab_size: int
    model_config: ModelConfig
    supports_media: bool
    multimodal: MultiModalConfig
    long_prompt_tokens: int  # longer prompts take the long lane (EngineConfig.long_prefill_token_threshold)
    prefill_chunk_tokens: int  # the most of one prompt a step computes (a snapshot interval, or the budget)
    reserve_tokens: int  # cache tokens long sequences leave to shorter ones
    full_context_cache_bytes: int  # the cache_memory_bytes that would hold max_position_embeddings
    max_schema_bytes: int | None = None

    @classmethod
    def of(cls, engine) -> EngineInfo:
        """engine: an LLMEngine."""
        return cls(engine.max_model_len, engine.vocab_size, engine.model_config, engine.supports_media,
                   engine.multimodal, engine.config.long_prefill_token_threshold, engine.prefill_chunk_tokens,
                   engine.reserve_tokens, engine.full_context_cache_bytes, engine.config.max_schema_bytes)
