"""One replica's engine: the tokenizer and model of a checkpoint, on a LocalExecutor (the model in
the replica's process) or a RayExecutor (pipeline stages / expert shards as actors in the
replica's placement group, bundles from 1 on; bundle 0 holds the replica). A checkpoint with a
vision tower takes images and videos: the tower runs in the replica's process beside a local
model, or as the pipeline's VisionEncoder actor."""

from __future__ import annotations

import asyncio
import functools
import math
import os

import torch

from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.flags import flag
from k3ray.config import VisionConfig
from k3ray.device import resolve_device
from k3ray.engine.async_engine import AsyncEngine
from k3ray.engine.config import DEFAULT_CACHE_BYTES, EngineConfig, SpeculativeConfig
from k3ray.engine.config import MultiModalConfig
from k3ray.engine.execution.executor import Executor, LocalExecutor
from k3ray.engine.llm_engine import LLMEngine
from k3ray.engine.media.inputs import load_media_config
from k3ray.engine.media.prompt_media import VisionEncoderFn, local_vision_encoder
from k3ray.engine.process.engine_client import EngineClient
from k3ray.engine.process.engine_info import EngineInfo
from k3ray.threads import set_threads
from k3ray.tokenizer import load_tokenizer
from k3ray.vision import has_vision_weights, load_vision
from k3ray.weights import load_model


def engine_config(args: ServeArgs) -> EngineConfig:
    e = args.engine
    spec = SpeculativeConfig("ngram", e.speculative_ngram) if e.speculative_ngram else None
    cache_bytes = None if e.cache_memory_mb is None else int(e.cache_memory_mb * 1024**2)
    return EngineConfig(
        max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
        max_model_len=e.max_model_len, block_size=e.block_size, cache_memory_bytes=cache_bytes,
        enable_prefix_caching=e.enable_prefix_caching, speculative=spec, seed=e.seed, enforce_eager=e.enforce_eager,
        long_prefill_token_threshold=e.long_prefill_token_threshold, long_context_reserve=e.long_context_reserve,
        max_schema_bytes=e.max_schema_bytes, grammar_compile_timeout_s=e.grammar_compile_timeout_s,
        grammar_compile_memory_bytes=int(e.grammar_compile_memory_mb * 1024**2),
        grammar_cache_bytes=int(e.grammar_cache_mb * 1024**2), grammar_compile_workers=e.grammar_compile_workers,
    )


def multimodal_config(args: ServeArgs, vision: VisionConfig) -> MultiModalConfig:
    """Media preprocessing (the checkpoint's preprocessor_config.json, or the tower's defaults) and
    the server's media limits."""
    m = args.media
    limit = {} if m.max_media_bytes is None else {"max_input_bytes": m.max_media_bytes}
    if m.max_request_pixels is not None:
        limit["max_request_pixels"] = m.max_request_pixels
    return MultiModalConfig(
        media=load_media_config(args.model.model, vision, **limit),
        max_items_per_prompt=m.max_media_per_prompt,
        allow_remote_urls=m.allow_remote_media_urls,
        fetch_timeout_s=m.media_fetch_timeout_s,
        allowed_local_media_path=m.allowed_local_media_path and os.path.abspath(m.allowed_local_media_path),
    )


def build_engine(args: ServeArgs, placement_group=None) -> tuple[LLMEngine, Executor]:
    """args must be resolved (a checkpoint path). The model's cache is allocated here."""
    path = args.model.model
    assert path is not None, "resolve() the args first"
    set_threads(args.engine.threads)
    dtype = getattr(torch, args.model.dtype)
    tokenizer = load_tokenizer(args.model.tokenizer or path)
    executor: Executor
    vision_encoder: VisionEncoderFn | None = None
    if args.distributed:
        # lazy: Ray only for a distributed layout: `k3ray bench serve --engine` builds this engine in process
        from k3ray.actors.pipeline.executor import RayExecutor

        offset = 0 if placement_group is None else 1
        executor = RayExecutor(path, args.parallel_config(), dtype=dtype, placement_group=placement_group,
                               bundle_offset=offset)
        if executor.has_vision:
            vision_encoder = executor.encode_media
    else:
        device = resolve_device(args.model.device)
        model = load_model(path, dtype=dtype, device=device)
        executor = LocalExecutor(model)  # on its model's device
        if model.config.vision is not None and has_vision_weights(path):
            vision_encoder = local_vision_encoder(load_vision(path, dtype, device))
    vision = executor.cache_layout()[0][0].vision
    multimodal = multimodal_config(args, vision) if vision_encoder is not None else None
    try:
        engine = LLMEngine(executor, engine_config(args), tokenizer, vision_encoder=vision_encoder,
                           multimodal=multimodal)
        engine.prepare_structured_outputs()  # now, not beside the steps of the first constrained request
    except BaseException:
        executor.shutdown()
        raise
    return engine, executor


async def start_replica_engine(args: ServeArgs, placement_group=None) -> tuple[AsyncEngine | EngineClient,
                                                                             Executor | None, object]:
    """A replica's engine, its executor (None: the engine process holds the model) and tokenizer: an
    undistributed model in an engine process of its own (engine.engine_process), else in this process
    on a RayExecutor (its actors in `placement_group`) or a LocalExecutor."""
    if args.engine.engine_process and not args.distributed:
        engine = await asyncio.to_thread(EngineClient.start, functools.partial(local_engine, args))
        tokenizer = await asyncio.to_thread(load_tokenizer, args.model.tokenizer or args.model.model)
        return engine, None, tokenizer
    llm_engine, executor = await asyncio.to_thread(build_engine, args, placement_group)
    return AsyncEngine(llm_engine), executor, llm_engine.tokenizer


def local_engine(args: ServeArgs) -> LLMEngine:
    """build_engine for an undistributed model, as an engine process's factory (picklable by name)."""
    assert not args.distributed, "a pipeline's actors belong to the replica, not to an engine process"
    return build_engine(args)[0]


def context_limit_note(args: ServeArgs, info: EngineInfo) -> str | None:
    """The start-up warning when the cache, not the model or --max-model-len, sets max_model_len
    (None when it does not): both numbers and the flags that raise it."""
    positions = info.model_config.max_position_embeddings
    if args.engine.max_model_len is not None or info.max_model_len >= positions:
        return None
    mb = 1024**2
    now = args.engine.cache_memory_mb or DEFAULT_CACHE_BYTES / mb
    reserve = f" beside the long-context reserve of {info.reserve_tokens} tokens" if info.reserve_tokens else ""
    return (f"max_model_len is {info.max_model_len} tokens, below the model's {positions} "
            f"(max_position_embeddings): that is all the cache holds{reserve}. {flag('cache_memory_mb')} "
            f"{math.ceil(info.full_context_cache_bytes / mb)} (now {now:g}) raises it to {positions}, and a lower "
            f"{flag('max_num_seqs')} leaves more of the cache to it; {flag('max_model_len')} only lowers it.")
