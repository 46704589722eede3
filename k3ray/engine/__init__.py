"""The serving engine: scheduler, caches, sampler, prefix cache, speculative decoding, media prompts
(Ray-free)."""

from k3ray.engine.async_engine import AsyncEngine
from k3ray.engine.config import EngineConfig, MultiModalConfig, SpeculativeConfig
from k3ray.engine.core.cache_manager import CacheGeometry, CacheManager, size_cache
from k3ray.engine.execution.executor import Executor, LocalExecutor
from k3ray.engine.execution.plan import BatchPlan, DraftPlan, StepPlan
from k3ray.engine.llm import LLM
from k3ray.engine.llm_engine import LLMEngine
from k3ray.engine.media.inputs import MediaInputError
from k3ray.engine.media.prompt_media import local_vision_encoder
from k3ray.engine.outputs import CompletionOutput, Logprob, OutputAccumulator, RequestMetrics, RequestOutput
from k3ray.engine.stats import EngineStats
from k3ray.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "BatchPlan",
    "CacheGeometry",
    "CacheManager",
    "CompletionOutput",
    "DraftPlan",
    "EngineConfig",
    "EngineStats",
    "Executor",
    "LLMEngine",
    "LocalExecutor",
    "Logprob",
    "MediaInputError",
    "MultiModalConfig",
    "OutputAccumulator",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SpeculativeConfig",
    "StepPlan",
    "StructuredOutputsParams",
    "local_vision_encoder",
    "size_cache",
]
