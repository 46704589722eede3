"""`k3ray bench engine`: what the engine adds on top of the model, on a tiny K3 in this process.

batching_speedup   generated tokens/s with `concurrency` requests in flight vs one at a time
host_ms_per_step   in that concurrent run, the engine's own milliseconds per step: scheduling, plans,
                   sampling, outputs, i.e. everything but the executor's forward (synchronised on
                   CUDA); a synchronous engine adds it to every decode step's forward
prefix_ttft_ratio  TTFT of a prompt sharing `prefix_shared` of its tokens with a cached one, over
                   TTFT of an unrelated prompt of the same length (both on a warm engine)
prefix_hit_tokens_after_scan  tokens of that shared prefix a prompt still resumes after it served
                   a hit and `prefix_scan_prompts` unrelated prompts then wrote twice as many
                   snapshots as the engine has spare slots (the prefix was `prefix_scan_shared`)
prefix_hit_tokens_first_half  tokens a prompt sharing the first half (`prefix_half_shared`) of a
                   prompt 4x `prefix_prompt_tokens` long resumes, when that prompt wrote four times
                   as many snapshots as the engine has spare slots
spec_speedup       plain over n-gram speculative wall time for repetitive text, and the draft
                   acceptance rate (the random tiny model never repeats itself, so this section
                   scales its attention outputs down until its greedy text loops: see config)
long_prompt_*      one prompt through chunked prefill: seconds and the peak RSS while it ran
engine_vs_forward_decode, cuda_graphs_speedup (CUDA only) engine decode tok/s at `concurrency`
                   streams with CUDA graphs over the bare captured-graph forward of the same
                   batch, and over the same engine run eagerly
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from typing import Any, Iterator

import psutil

from k3ray.bench.common import machine
from k3ray.bench.model import graph_decode_seconds
from k3ray.cli_flags import add_deprecated_alias
from k3ray.device_flags import add_device_argument, add_dtype_argument, add_enforce_eager_argument
from k3ray.model_source import add_random_model_argument, model_config
from k3ray.threads import add_threads_argument, set_threads

HELP = "continuous batching, prefix caching, speculative decoding, long prompts"
GIB = 1024**3
PREFIX_REPEATS = 3  # medians over this many cold and warm prompts
PREFIX_SCAN_PROMPTS = 4  # unrelated prompts between the shared prefix's hits in the scan run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_random_model_argument(parser)
    add_threads_argument(parser)
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight in the batching run")
    parser.add_argument("--sequential", type=int, default=8, help="requests timed one at a time")
    parser.add_argument("--batch-prompt-tokens", type=int, default=32, help="prompt tokens per batched request")
    parser.add_argument("--batch-max-tokens", type=int, default=32, help="new tokens per batched request")
    parser.add_argument("--prefix-prompt-tokens", type=int, default=2048,
                        help="prompt tokens of the prefix-cache run")
    parser.add_argument("--prefix-shared", type=float, default=0.9, help="share of those prompts that is a common prefix")
    parser.add_argument("--snapshot-interval", type=int, default=16, help="blocks between state snapshots")
    parser.add_argument("--speculative-ngram", type=int, default=4,
                        help="draft tokens per step by n-gram lookup in the speculative run")
    add_deprecated_alias(parser, "--spec-tokens", "--speculative-ngram", dest="speculative_ngram", type=int)
    parser.add_argument("--spec-max-tokens", type=int, default=64, help="new tokens of the speculative run")
    parser.add_argument("--spec-attn-scale", type=float, default=0.1,
                        help="attention weight scale of the draft-friendly model")
    parser.add_argument("--long-prompt-tokens", type=int, default=16384, help="e.g. 1048576 for 1M")
    parser.add_argument("--long-chunk", type=int, default=512, help="prefill tokens per step")
    add_dtype_argument(parser)
    parser.add_argument("--graph-max-tokens", type=int, default=128, help="decode steps timed per CUDA-graph run")
    parser.add_argument("--skip", nargs="*", default=[], choices=["batching", "prefix", "spec", "long", "graphs"],
                        help="runs to leave out (default: none)")
    add_device_argument(parser)
    add_enforce_eager_argument(parser)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.device import resolve_device
    from k3ray.models.init import build_model

    set_threads(args.threads)
    args.device = resolve_device(args.device)
    result: dict[str, Any] = {}
    model = build_model(model_config(args.model), getattr(torch, args.dtype), seed=0, device=args.device)
    if "graphs" not in args.skip and args.device.type == "cuda":
        result.update(bench_graphs(model, args))
    if "batching" not in args.skip:
        result.update(bench_batching(model, args))
    if "prefix" not in args.skip:
        result.update(bench_prefix(model, args))
        result.update(bench_prefix_scan(model, args))
        result.update(bench_prefix_first_half(model, args))
    if "spec" not in args.skip:
        result.update(bench_spec(args))
    if "long" not in args.skip:
        result.update(bench_long_prompt(model, args))
    result["machine"] = machine()
    result["config"] = {k: str(v) if k == "device" else v for k, v in vars(args).items()
                        if not k.startswith("_") and k != "json"}
    result["config"]["spec_model"] = (
        f"{args.model} with attention o_proj scaled by {args.spec_attn_scale} (greedy text loops)"
    )
    return result


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for _ in range(n)]


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) + 8


def bench_batching(model, args) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.engine import LLM, SamplingParams

    prompts = _prompts(args.concurrency, args.batch_prompt_tokens, 0)
    per_seq = args.batch_prompt_tokens + args.batch_max_tokens
    llm = LLM(model, max_num_seqs=args.concurrency, block_size=args.block_size, enforce_eager=args.enforce_eager,
              num_blocks=args.concurrency * _blocks(per_seq, args.block_size), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.batch_max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    with _forward_seconds(llm) as forwards:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    concurrent = args.concurrency * args.batch_max_tokens / wall
    t0 = time.perf_counter()
    for p in prompts[: args.sequential]:
        llm.generate([p], params)
    sequential = args.sequential * args.batch_max_tokens / (time.perf_counter() - t0)
    return {"batching_tokens_per_s": concurrent, "sequential_tokens_per_s": sequential,
            "batching_speedup": concurrent / sequential,
            "host_ms_per_step": (wall - sum(forwards)) / len(forwards) * 1e3,
            "forward_ms_per_step": sum(forwards) / len(forwards) * 1e3}


@contextlib.contextmanager
def _forward_seconds(llm) -> Iterator[list[float]]:
    """Within the block, the seconds of each executor.execute call (the forward), synchronised on CUDA."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    executor = llm.engine.executor
    execute = executor.execute
    seconds: list[float] = []

    def timed(plan):
        t0 = time.perf_counter()
        logits = execute(plan)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        seconds.append(time.perf_counter() - t0)
        return logits

    executor.execute = timed
    try:
        yield seconds
    finally:
        del executor.execute  # the class's method again


def bench_graphs(model, args) -> dict[str, Any]:
    """CUDA only: engine decode at `concurrency` streams with CUDA graphs, against the same engine
    eager and against the bare captured-graph forward of the same batch (no scheduler, no sampler)."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.engine import LLM, SamplingParams

    streams, steps = args.concurrency, args.graph_max_tokens
    prompts = _prompts(streams, 8, 5)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    tok_s = {}
    for name, eager in (("graphs", False), ("eager", True)):
        llm = LLM(model, max_num_seqs=streams, block_size=args.block_size, enforce_eager=eager,
                  num_blocks=streams * _blocks(8 + steps, args.block_size), enable_prefix_caching=False)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        tok_s[name] = streams * steps / (time.perf_counter() - t0)
        del llm
    forward = statistics.median(graph_decode_seconds(model, torch.randint(0, 256, (8,)), streams, steps, args.device)
                                for _ in range(3))
    forward_tok_s = streams * steps / forward
    return {"engine_decode_graphs_tok_s": tok_s["graphs"], "engine_decode_eager_tok_s": tok_s["eager"],
            "forward_decode_graphs_tok_s": forward_tok_s,
            "engine_vs_forward_decode": tok_s["graphs"] / forward_tok_s,
            "cuda_graphs_speedup": tok_s["graphs"] / tok_s["eager"]}


def bench_prefix(model, args) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.engine import LLM, SamplingParams

    n, shared = args.prefix_prompt_tokens, int(args.prefix_prompt_tokens * args.prefix_shared)
    stride = args.snapshot_interval * args.block_size
    llm = LLM(model, max_num_seqs=4, block_size=args.block_size, num_blocks=8 * _blocks(n, args.block_size),
              enforce_eager=args.enforce_eager,
              max_num_batched_tokens=n, snapshot_interval=args.snapshot_interval,
              num_snapshot_slots=4 * (n // stride + 2))
    params = SamplingParams(temperature=0, max_tokens=1)
    prompts = _prompts(2 + 2 * PREFIX_REPEATS, n, 1)
    base = prompts[1]
    llm.generate([prompts[0]], params)  # warm-up
    cold = [llm.generate([p], params)[0].metrics.ttft for p in prompts[2 : 2 + PREFIX_REPEATS]]
    llm.generate([base], params)  # caches the shared prefix
    hits = llm.get_stats().prefix_cache_hits
    warm = [llm.generate([base[:shared] + t[shared:]], params)[0].metrics.ttft for t in prompts[2 + PREFIX_REPEATS :]]
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {"prefix_ttft_cold_s": cold_s, "prefix_ttft_warm_s": warm_s, "prefix_ttft_ratio": warm_s / cold_s,
            "prefix_hit_tokens": (llm.get_stats().prefix_cache_hits - hits) // PREFIX_REPEATS}


def _snapshots_per_prompt(tokens: int, args) -> int:
    return tokens // (args.snapshot_interval * args.block_size) + 1  # interval snapshots + the prompt end


def bench_prefix_scan(model, args) -> dict[str, Any]:
    """A shared prefix that served a hit, then unrelated prompts whose snapshots overflow the spare
    slots twice over: how much of the prefix the next prompt sharing it resumes."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.engine import LLM, SamplingParams

    n, shared = args.prefix_prompt_tokens, int(args.prefix_prompt_tokens * args.prefix_shared)
    per_prompt = _snapshots_per_prompt(n, args)
    spare = PREFIX_SCAN_PROMPTS * per_prompt // 2
    llm = LLM(model, max_num_seqs=1, block_size=args.block_size, enforce_eager=args.enforce_eager,
              num_blocks=(PREFIX_SCAN_PROMPTS + 4) * _blocks(n, args.block_size),
              max_num_batched_tokens=n, snapshot_interval=args.snapshot_interval, num_snapshot_slots=spare)
    params = SamplingParams(temperature=0, max_tokens=1)
    prompts = _prompts(3 + PREFIX_SCAN_PROMPTS, n, 2)
    base = prompts[0]
    llm.generate([base], params)
    llm.generate([base[:shared] + prompts[1][shared:]], params)  # the hit that shows the prefix is shared
    for p in prompts[3:]:
        llm.generate([p], params)
    before = llm.get_stats().prefix_cache_hits
    llm.generate([base[:shared] + prompts[2][shared:]], params)
    return {"prefix_hit_tokens_after_scan": llm.get_stats().prefix_cache_hits - before,
            "prefix_scan_shared": shared, "prefix_scan_prompts": PREFIX_SCAN_PROMPTS}


def bench_prefix_first_half(model, args) -> dict[str, Any]:
    """A prompt with four times as many snapshots as spare slots, then one sharing its first half:
    how much of the half it resumes."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.engine import LLM, SamplingParams

    n = 4 * args.prefix_prompt_tokens
    snapshots = _snapshots_per_prompt(n, args)
    llm = LLM(model, max_num_seqs=1, block_size=args.block_size, enforce_eager=args.enforce_eager,
              num_blocks=3 * _blocks(n, args.block_size), max_num_batched_tokens=args.prefix_prompt_tokens,
              snapshot_interval=args.snapshot_interval, num_snapshot_slots=max(1, snapshots // 4))
    params = SamplingParams(temperature=0, max_tokens=1)
    long, other = _prompts(2, n, 3)
    llm.generate([long], params)
    llm.generate([long[: n // 2] + other[n // 2 :]], params)
    return {"prefix_hit_tokens_first_half": llm.get_stats().prefix_cache_hits, "prefix_half_shared": n // 2}


def bench_spec(args) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.engine import LLM, SamplingParams, SpeculativeConfig
    from k3ray.models.init import build_model

    model = build_model(model_config(args.model), getattr(torch, args.dtype), seed=0, device=args.device)
    with torch.no_grad():
        for layer in model.model.layers.values():
            layer.self_attn.o_proj.weight.mul_(args.spec_attn_scale)
    prompts = [[24, 423] * 3, list(b"the cat sat on the mat. the cat sat on the mat. the cat")]
    params = SamplingParams(temperature=0, max_tokens=args.spec_max_tokens, ignore_eos=True)
    common = dict(max_num_seqs=4, block_size=args.block_size, enable_prefix_caching=False, enforce_eager=args.enforce_eager,
                  num_blocks=4 * _blocks(args.spec_max_tokens + 64, args.block_size))
    plain = LLM(model, **common)
    spec = LLM(model, speculative=SpeculativeConfig("ngram", args.speculative_ngram), **common)
    times = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        llm.generate(prompts, params)  # warm-up
        t0 = time.perf_counter()
        outs = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        times[name] = time.perf_counter() - t0
        times[name + "_tokens"] = outs
    assert times["plain_tokens"] == times["spec_tokens"], "speculative greedy diverged from plain greedy"
    stats = spec.get_stats()
    return {"spec_speedup": times["plain"] / times["spec"], "spec_acceptance": stats.spec_acceptance_rate,
            "spec_mean_accepted": stats.spec_mean_accepted}


def bench_long_prompt(model, args) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.engine import LLM, SamplingParams

    n = args.long_prompt_tokens
    llm = LLM(model, max_num_seqs=1, block_size=args.block_size, num_blocks=_blocks(n + 2, args.block_size),
              enforce_eager=args.enforce_eager,
              max_num_batched_tokens=args.long_chunk, enable_prefix_caching=False)
    prompt = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    peak = _PeakRss()
    with peak:
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        seconds = time.perf_counter() - t0
    assert len(out.outputs[0].token_ids) == 1
    return {"long_prompt_tokens": n, "long_prompt_s": seconds, "long_prompt_tokens_per_s": n / seconds,
            "long_prompt_peak_rss_gib": peak.max_rss / GIB,
            "long_prompt_cache_gib": llm.get_stats().cache["bytes_total"] / GIB}


class _PeakRss:
    """Samples this process's RSS every 20 ms while the block runs."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.max_rss = self.proc.memory_info().rss
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.max_rss = max(self.max_rss, self.proc.memory_info().rss)

    def __enter__(self) -> "_PeakRss":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.max_rss = max(self.max_rss, self.proc.memory_info().rss)
