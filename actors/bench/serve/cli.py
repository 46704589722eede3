"""`k3ray bench serve`: vLLM-style serving benchmark of an OpenAI-compatible endpoint, and the
served / in-process throughput ratio.

Without --endpoint it starts k3ray's Serve app on 127.0.0.1 (the tiny K3 unless --model)
and stops it afterwards. For each --concurrency level, --num-prompts requests arrive at
--request-rate (inf: all at once; else Poisson / gamma gaps with --burstiness) with at most that
many in flight, streamed over SSE; the same requests then run on the in-process engine at the
same concurrency (built from the same settings as the served replica), interleaved --repeats
times. The JSON holds vllm bench serve's keys (of the highest level), `levels` (one row per
level) and `served_vs_engine_tok_s` (served / engine output tokens/s at the highest level).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import statistics
from typing import Any

from k3ray.api_keys import CLIENT_API_KEY_HELP, client_api_key
from k3ray.bench.common import machine
from k3ray.cli_flags import add_deprecated_alias
from k3ray.actors.bench.serve import datasets
from k3ray.threads import add_threads_argument, resolved_threads

HELP = "served TTFT / TPOT / ITL / throughput vs the in-process engine"
LEVEL_KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
              "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "request_goodput", "completed", "failed")


def _levels(text: str) -> list[int | None]:
    levels: list[int | None] = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        if part in ("inf", "none"):
            levels.append(None)
        elif part.isdigit() and int(part) >= 1:
            levels.append(int(part))
        else:
            raise ValueError(f"--concurrency entries are integers >= 1 or inf, got {part!r}")
    if not levels:
        raise ValueError(f"--concurrency names no level: {text!r}")
    return levels


def _percentiles(text: str) -> list[float]:
    try:
        values = sorted({float(p) for p in text.split(",") if p.strip()} | {99.0})
    except ValueError:
        raise ValueError(f"--metric-percentiles are numbers like 50,90,99, got {text!r}") from None
    if any(not 0 < p < 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100), got {text!r}")
    return values


def _rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # strict JSON has no Infinity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.bench.serve import pd, ramp, shared_prefix

    parser.add_argument("--workload", choices=("levels", "ramp", "shared-prefix", "pd"), default="levels",
                        help="levels: throughput and latency per --concurrency level against the in-process engine; "
                        "ramp: autoscaling under a ramp of load, the llm policy vs ongoing requests (ramp.py); "
                        "shared-prefix: conversations in groups sharing a long prefix, over 2 replicas, "
                        "prefix-affinity routing vs Serve's default, and 1 replica (shared_prefix.py); pd: decode "
                        "streams' ITL while long prompts arrive, prefill/decode disaggregation vs colocated "
                        "replicas, and the handoffs (pd.py)")
    parser.add_argument("--endpoint", help="server URL (default: start k3ray's Serve app on 127.0.0.1)")
    parser.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                        help="without --endpoint: HAProxy + each replica's own HTTP server, or Serve's proxy actor")
    parser.add_argument("--model", metavar="DIR",
                        help="checkpoint served locally and run in process (default: tiny K3); with --endpoint, the "
                        "in-process side of served_vs_engine_tok_s")
    add_deprecated_alias(parser, "--checkpoint", "--model", dest="model")
    parser.add_argument("--served-model-name", help="the model name the endpoint serves (default: the first of "
                        "/v1/models)")
    parser.add_argument("--api-key", default=client_api_key(), help=CLIENT_API_KEY_HELP)
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process engine runs")
    parser.add_argument("--dataset", choices=datasets.DATASETS, default="random",
                        help="random token ids, or long prompts of the bundled text")
    parser.add_argument("--prompt-tokens", dest="input_len", type=int,
                        help="prompt tokens (mean; default: 32, ramp 2048, shared-prefix 4096: a group's shared prefix)")
    add_deprecated_alias(parser, "--input-len", "--prompt-tokens", dest="input_len", type=int)
    parser.add_argument("--max-tokens", dest="output_len", type=int,
                        help="generated tokens (mean; EOS ignored; default: 16, ramp 8, shared-prefix 4)")
    add_deprecated_alias(parser, "--output-len", "--max-tokens", dest="output_len", type=int)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * (1 +- ratio)")
    parser.add_argument("--num-prompts", type=int, help="requests per level (default: 2 x concurrency, at least 4)")
    parser.add_argument("--concurrency", default="1,8,64",
                        help="requests in flight, one level per comma-separated value (inf: no cap)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="SLO", help="service-level objectives in ms, e.g. ttft:500 tpot:50 e2el:2000 (default: none)")
    parser.add_argument("--metric-percentiles", default="50,99", help="percentiles reported (99 always)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved served / engine runs per level (median)")
    parser.add_argument("--warmups", type=int, default=1, help="untimed requests before the levels")
    parser.add_argument("--max-num-seqs", type=int, help="locally served engine batch (default: max level, >= 64)")
    add_threads_argument(parser, "the served replica and of the in-process engine (the same)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival gaps")
    parser.add_argument("--save-detailed", action="store_true",
                        help="also the per-request lists (ttfts, itls, latencies, ...) of the highest level")
    ramp.add_arguments(parser)
    shared_prefix.add_arguments(parser)
    pd.add_arguments(parser)


def _serve_args(args: argparse.Namespace, levels: list[int | None], max_prompts: int) -> dict[str, Any]:
    widest = max(level or max_prompts for level in levels)
    max_len = int(args.input_len * (1 + args.range_ratio)) + int(args.output_len * (1 + args.range_ratio)) + 2
    return {"model": {"model": args.model}, "server": {"max_queued_requests": -1},
            "engine": {"max_num_seqs": args.max_num_seqs or max(64, widest), "max_model_len": max_len,
                       "threads": resolved_threads(args.threads)}}


def _requests(args: argparse.Namespace, n: int, seed: int, token_range, tokenize) -> list[datasets.BenchRequest]:
    if args.dataset == "random":
        return datasets.random_requests(n, args.input_len, args.output_len, token_range, args.range_ratio, seed)
    return datasets.long_requests(n, args.input_len, args.output_len, tokenize, args.range_ratio, seed)


async def _served(url: str, model: str, requests, offsets, concurrency, timeout,
                  api_key: str | None = None) -> tuple[list[RequestResult], float]:
    # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.bench.serve.client import RequestResult, open_session, stream_completion
    from k3ray.actors.bench.serve.load import arrival_offsets, run_load

    async with open_session(concurrency, timeout, api_key) as session:
        return await run_load(lambda r: stream_completion(session, url, model, r), requests, offsets, concurrency)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.bench.serve import metrics

    if args.workload == "ramp":
        # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
        from k3ray.actors.bench.serve import ramp

        return ramp.run(args)
    if args.workload == "shared-prefix":
        # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
        from k3ray.actors.bench.serve import shared_prefix

        return shared_prefix.run(args)
    if args.workload == "pd":
        # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
        from k3ray.actors.bench.serve import pd

        return pd.run(args)
    args.input_len = 32 if args.input_len is None else args.input_len
    args.output_len = 16 if args.output_len is None else args.output_len
    levels = _levels(args.concurrency)
    percentiles = _percentiles(args.metric_percentiles)
    slos = metrics.parse_goodput(args.goodput)
    # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    import torch

    for name in ("repeats", "input_len", "output_len", "num_prompts", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmups < 0 or not 0 <= args.range_ratio < 1:
        raise ValueError(f"--warmups must be >= 0 and --range-ratio in [0, 1), got {args.warmups}, {args.range_ratio}")
    counts = {level: args.num_prompts or max(4, 2 * (level or 2)) for level in levels}
    serve_args = _serve_args(args, levels, max(counts.values()))
    threads = torch.get_num_threads()
    try:
        if args.endpoint is not None:
            return _bench(args, args.endpoint.rstrip("/"), levels, counts, percentiles, slos, serve_args)
        # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
        from k3ray.actors.bench.serve.server import local_serve_app

        with local_serve_app(serve_args, ingress=args.ingress) as url:
            return _bench(args, url, levels, counts, percentiles, slos, serve_args)
    finally:
        torch.set_num_threads(threads)  # build_engine set the replica's thread count in this process


def _engine(args: argparse.Namespace, serve_args: dict[str, Any]):
    """The served replica's engine, rebuilt in this process from the same settings."""
    if args.no_engine or (args.endpoint is not None and args.model is None):
        return None
    # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve.config import ServeArgs
    from k3ray.actors.serve.engine import build_engine

    engine, _ = build_engine(ServeArgs.model_validate(serve_args).resolved())
    return engine


def _level(args, url, model, engine, batches, offsets, level, percentiles, slos):
    """Interleaved served / in-process runs of one level, one per batch of requests (fresh prompts
    each time, so no run reuses another's prefix cache): (its `levels` row, the served metrics of
    the median-throughput run, that run's per-request results)."""
    # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.bench.serve import metrics
    from k3ray.actors.bench.serve.engine_side import run_on_engine

    runs = []
    for requests in batches:
        results, duration = asyncio.run(_served(url, model, requests, offsets, level, args.timeout, args.api_key))
        served = metrics.calculate_metrics(results, duration, percentiles, slos)
        on_engine = run_on_engine(engine, requests, level or len(requests)) if engine is not None else None
        runs.append((served, results, on_engine))
    runs.sort(key=lambda run: run[0]["output_throughput"])
    served, results, _ = runs[(len(runs) - 1) // 2]
    engine_tok_s = ratio = None
    if engine is not None:
        engine_tok_s = statistics.median(run[2]["output_throughput"] for run in runs)
        ratio = statistics.median(run[0]["output_throughput"] / run[2]["output_throughput"] for run in runs)
    row = {"concurrency": level, **{k: served[k] for k in LEVEL_KEYS},
           "engine_output_throughput": engine_tok_s, "served_vs_engine_tok_s": ratio}
    return row, served, results


def _bench(args, url, levels, counts, percentiles, slos, serve_args) -> dict[str, Any]:
    # lazy: aiohttp, httpx, torch, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    import httpx

    from k3ray.actors.bench.serve import metrics
    from k3ray.actors.bench.serve.engine_side import run_on_engine
    from k3ray.actors.bench.serve.load import arrival_offsets, run_load
    from k3ray.actors.bench.serve.server import auth_headers, server_facts

    model, tokenizer_info = server_facts(url, args.served_model_name, api_key=args.api_key)
    engine = _engine(args, serve_args)

    def tokenize(text: str) -> list[int]:
        response = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=args.timeout,
                              headers=auth_headers(args.api_key))
        response.raise_for_status()
        return response.json()["tokens"]

    token_range = datasets.ordinary_token_range(tokenizer_info) if args.dataset == "random" else None
    if args.warmups:
        warm = _requests(args, args.warmups, args.seed + 999_999, token_range, tokenize)
        asyncio.run(_served(url, model, warm, [0.0] * len(warm), None, args.timeout, args.api_key))
        if engine is not None:
            run_on_engine(engine, warm, None)
    rows, last = [], None
    for index, level in enumerate(levels):
        seeds = [args.seed + 1000 * index + repeat for repeat in range(args.repeats)]
        batches = [_requests(args, counts[level], seed, token_range, tokenize) for seed in seeds]
        offsets = arrival_offsets(counts[level], args.request_rate, args.burstiness, args.seed + index)
        row, served, results = _level(args, url, model, engine, batches, offsets, level, percentiles, slos)
        rows.append(row)
        last = (level, served, results)
    level, served, results = last
    result = {
        "served_vs_engine_tok_s": rows[-1]["served_vs_engine_tok_s"],
        "ingress": None if args.endpoint is not None else args.ingress,
        "levels": rows,
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai", "endpoint_type": "openai", "base_url": url, "model_id": model,
        "num_prompts": counts[level], "request_rate": _rate(args.request_rate), "burstiness": args.burstiness,
        "max_concurrency": level,
        **served,
    }
    if args.save_detailed:
        result |= metrics.per_request_lists(results)
    result["machine"] = machine()
    result["config"] = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("json", "api_key")}
    result["config"]["request_rate"] = _rate(args.request_rate)
    result["config"]["serve_args"] = serve_args if args.endpoint is None else None
    return result
