"""What a server needs to know about an engine it does not hold (EngineClient's engine lives in
another process): limits for request checks and the media setup."""

from __future__ import annotations

from dataclasses import dataclass

from k3ray.config import ModelConfig
from k3ray.engine.media_inputs import MultiModalConfig


@dataclass(frozen=True)
class EngineInfo:
    max_model_len: int
    vocab_size: int
    model_config: ModelConfig
    supports_media: bool
    multimodal: MultiModalConfig
    max_schema_bytes: int | None = None

    @classmethod
    def of(cls, engine) -> EngineInfo:
        """engine: an LLMEngine."""
        return cls(engine.max_model_len, engine.vocab_size, engine.model_config, engine.supports_media,
                   engine.multimodal, engine.config.max_schema_bytes)
