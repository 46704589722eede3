"""`k3ray bench serve --workload shared-prefix`: multi-turn conversations over two replicas, with
prefix-affinity routing against Serve's default routing (HAProxy by connections), and on one
replica, the same requests each time.

--conversations conversations, one starting every --start-gap-s seconds, each --turns turns one
after another. A turn's prompt is
the turn before's prompt, its reply as a client resends it (--max-tokens tokens) and a new message
(--turn-len tokens); the first prompt has --prompt-tokens tokens (random ordinary token ids, a fresh
seed per conversation, so conversations share nothing). Each configuration gets a fresh app on one
local Ray instance (haproxy ingress), a warm-up conversation, then the workload. The prefix-cache
hit rate (prompt tokens resumed from the cache / prompt tokens looked up, summed over the replicas'
own counters, scraped from each replica's metrics listener) and the client-side mean TTFT are
measured per configuration: `affinity_hit_rate`, `default_hit_rate`, `single_replica_hit_rate`,
`affinity_ttft_ratio` (mean TTFT with affinity / with the default router).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from k3ray.actors.serve.config import APP_NAME
from k3ray.bench.common import machine
from k3ray.evals.serve_bench.client import open_session, stream_completion
from k3ray.evals.serve_bench.datasets import BenchRequest, ordinary_token_range
from k3ray.evals.serve_bench.server import server_facts, wait_healthy
from k3ray.threads import resolved_threads

INPUT_LEN, OUTPUT_LEN = 1024, 4  # defaults: a first prompt whose prefill dominates a turn's TTFT
CONFIGS = {"affinity": (2, "affinity"), "default": (2, "default"), "single_replica": (1, "default")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--workload shared-prefix", f"the first prompt has --prompt-tokens tokens "
                                      f"(default {INPUT_LEN}), a reply --max-tokens (default {OUTPUT_LEN})")
    group.add_argument("--conversations", type=int, default=8, help="conversations at once (default 8)")
    group.add_argument("--turns", type=int, default=8, help="turns per conversation (default 8)")
    group.add_argument("--turn-len", type=int, default=64, help="tokens of each new message (default 64)")
    group.add_argument("--start-gap-s", type=float, default=0.5,
                       help="seconds between the starts of two conversations (default 0.5)")


def conversations(count: int, turns: int, first_len: int, turn_len: int, output_len: int,
                  token_range: tuple[int, int], seed: int) -> list[list]:
    """`count` conversations of `turns` requests, each prompt extending the one before."""
    low, high = token_range
    out = []
    for c in range(count):
        rng = np.random.default_rng([seed, c])
        prompt = rng.integers(low, high, size=first_len).tolist()
        requests = []
        for _ in range(turns):
            requests.append(BenchRequest(tuple(prompt), output_len))
            prompt += rng.integers(low, high, size=output_len + turn_len).tolist()
        out.append(requests)
    return out


async def run_conversations(url: str, model: str, convs: list[list], timeout: float,
                            api_key: str | None, start_gap_s: float = 0.0) -> list:
    """Conversation c starts after c * start_gap_s seconds, each turn after the one before: the
    RequestResults, in order."""
    async with open_session(len(convs), timeout, api_key) as session:
        async def turns(index, requests):
            await asyncio.sleep(index * start_gap_s)
            return [await stream_completion(session, url, model, r) for r in requests]

        per_conversation = await asyncio.gather(*(turns(i, c) for i, c in enumerate(convs)))
    return [result for results in per_conversation for result in results]


def prefix_counters(replicas: int, timeout_s: float = 60.0) -> tuple[float, float]:
    """(prefix-cache hit tokens, looked-up tokens) summed over the app's `replicas` live replicas,
    from each replica's metrics listener (announced in the server's runtime folder)."""
    # lazy: Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve.haproxy_wrapper import announced_listeners
    from k3ray.actors.serve.metrics_listener import runtime_dir

    deadline = time.monotonic() + timeout_s
    while len(ports := announced_listeners(runtime_dir()).get(APP_NAME, [])) != replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{replicas} replica metrics listeners expected, found {len(ports)}")
        time.sleep(0.5)
    totals = {"k3ray:prefix_cache_hits": 0.0, "k3ray:prefix_cache_queries": 0.0}
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.removesuffix("_total") in totals:
                    totals[sample.name.removesuffix("_total")] += sample.value
    return totals["k3ray:prefix_cache_hits"], totals["k3ray:prefix_cache_queries"]


def measure(args, serve_args: dict, name: str, lengths: tuple[int, int]) -> dict[str, Any]:
    """Deploy one configuration, warm it up, run the workload (the same for every configuration):
    its hit rate and TTFTs. lengths: (first prompt, reply) tokens."""
    # lazy: Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve.ingress_routing import haproxy_routes_through_router

    replicas, router = CONFIGS[name]
    app_args = {**serve_args, "autoscaling": {"min_replicas": replicas, "max_replicas": replicas},
                "routing": {"request_router": router, "routing_stats_period_s": 1.0}}
    url = serve_launch.deploy(app_args, host="127.0.0.1", port=args._port, proxy_location="HeadOnly")
    wait_healthy(url)
    deadline = time.monotonic() + 120
    while router == "affinity" and not haproxy_routes_through_router(replicas):
        if time.monotonic() > deadline:
            raise RuntimeError("HAProxy did not come to route through the ingress router")
        time.sleep(0.5)
    time.sleep(2.0)  # HAProxy reloads the config it was given; the replicas of the last app drain
    model, info = server_facts(url, args.served_model_name, api_key=args.api_key)
    token_range = ordinary_token_range(info)
    convs = conversations(args.conversations, args.turns, lengths[0], args.turn_len, lengths[1], token_range,
                          args.seed)
    warm = conversations(1, 2, lengths[0], args.turn_len, lengths[1], token_range, args.seed + 999_999)
    asyncio.run(run_conversations(url, model, warm, args.timeout, args.api_key))
    hits_before, queries_before = prefix_counters(replicas)
    start = time.perf_counter()
    results = asyncio.run(run_conversations(url, model, convs, args.timeout, args.api_key, args.start_gap_s))
    duration = time.perf_counter() - start
    hits, queries = prefix_counters(replicas)
    ok = [r for r in results if r.success]
    ttfts = sorted(r.ttft * 1000 for r in ok)
    return {"replicas": replicas, "request_router": router, "completed": len(ok), "failed": len(results) - len(ok),
            "hit_rate": (hits - hits_before) / (queries - queries_before) if queries > queries_before else None,
            "prompt_tokens": int(queries - queries_before), "cached_tokens": int(hits - hits_before),
            "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
            "p50_ttft_ms": ttfts[len(ttfts) // 2] if ttfts else None,
            "p99_ttft_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "duration_s": duration, "errors": sorted({r.error[:200] for r in results if not r.success})}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.endpoint is not None:
        raise ValueError("--workload shared-prefix starts its own apps (two replicas, then one); drop --endpoint")
    # lazy: Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve.isolation import free_port

    for name in ("conversations", "turns", "turn_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    input_len = args.input_len or INPUT_LEN
    output_len = args.output_len or OUTPUT_LEN
    longest = input_len + (args.turns - 1) * (output_len + args.turn_len)
    serve_args = {"model": {"model": args.model}, "server": {"max_queued_requests": -1},
                  # twice the conversations: a live state slot each, and as many snapshot slots (one replica
                  # holds every conversation's latest prefix; the one-replica hit rate is the reference)
                  "engine": {"max_num_seqs": 2 * args.conversations, "max_model_len": longest + output_len + 2,
                             "threads": resolved_threads(args.threads)}}
    started = serve_launch.start_ray(ingress="haproxy", num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    args._port = free_port()
    try:
        rows = {name: measure(args, serve_args, name, (input_len, output_len)) for name in CONFIGS}
    finally:
        serve_launch.stop(owns_ray=started)
    affinity, default, single = rows["affinity"], rows["default"], rows["single_replica"]
    ratio = None
    if affinity["mean_ttft_ms"] and default["mean_ttft_ms"]:
        ratio = affinity["mean_ttft_ms"] / default["mean_ttft_ms"]
    return {
        "affinity_hit_rate": affinity["hit_rate"], "default_hit_rate": default["hit_rate"],
        "single_replica_hit_rate": single["hit_rate"], "affinity_ttft_ratio": ratio,
        "affinity_vs_single_hit_rate": (affinity["hit_rate"] / single["hit_rate"]
                                        if affinity["hit_rate"] is not None and single["hit_rate"] else None),
        "runs": rows,
        "workload": {"conversations": args.conversations, "turns": args.turns, "input_len": input_len,
                     "start_gap_s": args.start_gap_s,
                     "turn_len": args.turn_len, "output_len": output_len, "requests": args.conversations * args.turns},
        "machine": machine(),
        "config": {"serve_args": serve_args, "seed": args.seed, "ingress": "haproxy"},
    }

