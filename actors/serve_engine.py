"""One replica's engine: the tokenizer and model of a checkpoint, on a LocalExecutor (the model in
the replica's process) or a RayExecutor (pipeline stages / expert shards as actors in the
replica's placement group, bundles from 1 on; bundle 0 holds the replica)."""

from __future__ import annotations

import torch

from k3ray.actors.serve_config import ServeArgs
from k3ray.engine.config import EngineConfig, SpeculativeConfig
from k3ray.engine.executor import Executor, LocalExecutor
from k3ray.engine.llm_engine import LLMEngine


def engine_config(args: ServeArgs) -> EngineConfig:
    spec = SpeculativeConfig("ngram", args.speculative_ngram) if args.speculative_ngram else None
    cache_bytes = None if args.cache_memory_mb is None else int(args.cache_memory_mb * 1024**2)
    return EngineConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, block_size=args.block_size, cache_memory_bytes=cache_bytes,
        enable_prefix_caching=args.enable_prefix_caching, speculative=spec, seed=args.seed,
    )


def build_engine(args: ServeArgs, placement_group=None) -> tuple[LLMEngine, Executor]:
    """args must be resolved (a checkpoint path). The model's cache is allocated here."""
    from k3ray.tokenizer import load_tokenizer
    from k3ray.weights import load_model

    assert args.model is not None, "resolve() the args first"
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = load_tokenizer(args.model)
    executor: Executor
    if args.distributed:
        from k3ray.actors.ray_executor import RayExecutor

        offset = 0 if placement_group is None else 1
        executor = RayExecutor(args.model, args.parallel_config(), dtype, placement_group, bundle_offset=offset)
    else:
        executor = LocalExecutor(load_model(args.model, dtype=dtype))
    try:
        engine = LLMEngine(executor, engine_config(args), tokenizer)
    except BaseException:
        shutdown = getattr(executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
        raise
    return engine, executor
