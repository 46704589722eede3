"""`k3ray bench serve --workload shared-prefix`: multi-turn conversations in groups that share a long
prefix, over two replicas, with prefix-affinity routing against Serve's default routing (HAProxy by
connections), and on one replica; the same requests each time.

--conversations conversations of --turns turns each, one turn after another, in --prefix-groups
groups of (as nearly as may be) equal size. A conversation's first prompt is its group's prefix
(--prompt-tokens random ordinary token ids, shared by the group) and an opening message of its own
(--turn-len tokens); each later prompt is the turn before's prompt, its reply as a client resends it
(--max-tokens tokens) and a new message (--turn-len tokens). One conversation per group opens it:
those start one every --start-gap-s seconds, and once each has had its first turn (its group's
prefix is cached somewhere) the rest start likewise, their groups in a seeded random order; so what
a prefix costs depends on where the router sends the group, not on two prompts racing to compute it.
A prefix of a multiple of 1,024 tokens (the engine's snapshot stride) resumes whole.

Each configuration gets a fresh app on one local Ray instance (haproxy ingress), a warm-up
conversation per replica, then the workload. --repeats runs of the two routers alternate their
order; the one-replica reference runs once. Each replica's own counters (scraped from its metrics
listener before and after the workload) give the prompt tokens it computed by prefill (prefix-cache
hits excluded: `k3ray:prompt_tokens`), and resumed from / looked up in its prefix cache; the client
gives the TTFT. Keys: `affinity_hit_rate`, `default_hit_rate`, `single_replica_hit_rate` (resumed /
looked-up tokens over every run), `affinity_ttft_ratio` (mean TTFT with affinity / with the default
router, the median over the repeats), `affinity_ttft_ratio_spread` ([min, max] of it over the
repeats), `prefill_tokens_per_replica` ({configuration: per repeat, the tokens each replica
computed, most first}), `affinity_prefill_ratio` (total prefill tokens affinity / default, median).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from k3ray.actors.serve.config import APP_NAME
from k3ray.bench.common import machine
from k3ray.actors.bench.serve.client import open_session, stream_completion
from k3ray.actors.bench.serve.datasets import BenchRequest, ordinary_token_range
from k3ray.actors.bench.serve.server import server_facts, wait_healthy
from k3ray.threads import resolved_threads

PREFIX_LEN, OUTPUT_LEN = 4096, 4  # defaults: a group's prefix whose prefill dominates a first turn's TTFT
CONFIGS = {"affinity": (2, "affinity"), "default": (2, "default"), "single_replica": (1, "default")}
COUNTERS = ("k3ray:prompt_tokens", "k3ray:prefix_cache_hits", "k3ray:prefix_cache_queries")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--workload shared-prefix", f"a group's shared prefix has --prompt-tokens "
                                      f"tokens (default {PREFIX_LEN}), a reply --max-tokens (default {OUTPUT_LEN}); "
                                      "--repeats runs of each router")
    group.add_argument("--conversations", type=int, default=16, help="conversations (default 16)")
    group.add_argument("--prefix-groups", type=int, default=4,
                       help="groups of conversations, each sharing its own prefix (default 4)")
    group.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    group.add_argument("--turn-len", type=int, default=64, help="tokens of each new message (default 64)")
    group.add_argument("--start-gap-s", type=float, default=0.25,
                       help="seconds between the starts of two conversations (default 0.25)")


def group_of(count: int, groups: int, seed: int) -> list[int]:
    """Each conversation's group: the first `groups` open one each, the rest take turns among the
    groups in a seeded random order (so that no alternation between replicas follows the groups)."""
    rest = [c % groups for c in range(count - groups)]
    return list(range(groups)) + np.random.default_rng([seed, 2]).permutation(rest).tolist()


def conversations(count: int, turns: int, prefix_len: int, turn_len: int, output_len: int,
                  token_range: tuple[int, int], seed: int, groups: int = 1) -> list[list]:
    """`count` conversations of `turns` requests, each prompt extending the one before; a
    conversation opens with its group's prefix (prefix_len tokens, group_of) and turn_len tokens of
    its own."""
    low, high = token_range
    prefixes = [np.random.default_rng([seed, 1, g]).integers(low, high, size=prefix_len).tolist()
                for g in range(groups)]
    out = []
    for c, group in enumerate(group_of(count, groups, seed)):
        rng = np.random.default_rng([seed, 0, c])
        prompt = prefixes[group] + rng.integers(low, high, size=turn_len).tolist()
        requests = []
        for _ in range(turns):
            requests.append(BenchRequest(tuple(prompt), output_len))
            prompt += rng.integers(low, high, size=output_len + turn_len).tolist()
        out.append(requests)
    return out


async def run_conversations(url: str, model: str, convs: list[list], timeout: float,
                            api_key: str | None, start_gap_s: float = 0.0, openers: int = 0) -> list:
    """Each turn after the one before; the first `openers` conversations start one every start_gap_s
    seconds, the rest likewise once the openers have had their first turn: the RequestResults, in
    order."""
    opened, waiting = asyncio.Event(), openers
    if not openers:
        opened.set()

    async with open_session(len(convs), timeout, api_key) as session:
        async def turns(index, requests):
            nonlocal waiting
            if index >= openers:
                await opened.wait()
            await asyncio.sleep((index if index < openers else index - openers) * start_gap_s)
            results = []
            for request in requests:
                results.append(await stream_completion(session, url, model, request))
                if index < openers and len(results) == 1:
                    waiting -= 1
                    if not waiting:
                        opened.set()
            return results

        per_conversation = await asyncio.gather(*(turns(i, c) for i, c in enumerate(convs)))
    return [result for results in per_conversation for result in results]


def replica_counters(replicas: int, timeout_s: float = 60.0) -> dict[int, dict[str, float]]:
    """{metrics listener port: {counter: value}} of COUNTERS for each of the app's `replicas` live
    replicas, from its metrics listener (announced in the server's runtime folder)."""
    # lazy: Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve.haproxy_wrapper import announced_listeners
    from k3ray.actors.serve.metrics_listener import runtime_dir

    deadline = time.monotonic() + timeout_s
    while len(ports := announced_listeners(runtime_dir()).get(APP_NAME, [])) != replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{replicas} replica metrics listeners expected, found {len(ports)}")
        time.sleep(0.5)
    found = {}
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        values = dict.fromkeys(COUNTERS, 0.0)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (name := sample.name.removesuffix("_total")) in values:
                    values[name] += sample.value
        found[port] = values
    return found


def counted(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]) -> dict[str, Any]:
    """What the replicas counted between two scrapes: per replica (most first) the prompt tokens
    computed by prefill, and the prefix-cache hit and looked-up tokens summed over them."""
    if set(before) != set(after):
        raise RuntimeError(f"the replicas changed during the workload (metrics listeners {sorted(before)} -> "
                           f"{sorted(after)})")
    delta = {port: {k: int(after[port][k] - before[port][k]) for k in COUNTERS} for port in after}
    return {"prefill_tokens_per_replica": sorted((d["k3ray:prompt_tokens"] for d in delta.values()), reverse=True),
            "cached_tokens": sum(d["k3ray:prefix_cache_hits"] for d in delta.values()),
            "looked_up_tokens": sum(d["k3ray:prefix_cache_queries"] for d in delta.values())}


def measure(args, serve_args: dict, name: str, deploy: Callable[[dict], str]) -> dict[str, Any]:
    """Deploy one configuration (deploy(app args) -> URL), warm it up, run the workload (the same for
    every configuration): what its replicas computed and the TTFTs."""
    # lazy: Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve.ingress_routing import haproxy_routes_through_router

    replicas, router = CONFIGS[name]
    app_args = {**serve_args, "autoscaling": {"min_replicas": replicas, "max_replicas": replicas},
                "routing": {"request_router": router, "routing_stats_period_s": 1.0}}
    url = deploy(app_args)
    wait_healthy(url)
    deadline = time.monotonic() + 120
    while router == "affinity" and not haproxy_routes_through_router(replicas):
        if time.monotonic() > deadline:
            raise RuntimeError("HAProxy did not come to route through the ingress router")
        time.sleep(0.5)
    time.sleep(2.0)  # HAProxy reloads the config it was given; the replicas of the last app drain
    model, info = server_facts(url, args.served_model_name, api_key=args.api_key)
    token_range = ordinary_token_range(info)
    convs = conversations(args.conversations, args.turns, args.input_len, args.turn_len, args.output_len,
                          token_range, args.seed, args.prefix_groups)
    warm = conversations(replicas, 2, args.input_len, args.turn_len, args.output_len, token_range,
                         args.seed + 999_999, replicas)  # one at a time per replica, no prefix shared
    asyncio.run(run_conversations(url, model, warm, args.timeout, args.api_key))
    before = replica_counters(replicas)
    start = time.perf_counter()
    results = asyncio.run(run_conversations(url, model, convs, args.timeout, args.api_key, args.start_gap_s,
                                          openers=args.prefix_groups))
    duration = time.perf_counter() - start
    counts = counted(before, replica_counters(replicas))
    ok = [r for r in results if r.success]
    ttfts = sorted(r.ttft * 1000 for r in ok)
    firsts = [r.ttft * 1000 for r in results[:: args.turns] if r.success]  # each conversation's first turn
    looked_up = counts["looked_up_tokens"]
    return {"replicas": replicas, "request_router": router, "completed": len(ok), "failed": len(results) - len(ok),
            **counts, "prefill_tokens": sum(counts["prefill_tokens_per_replica"]),
            "hit_rate": counts["cached_tokens"] / looked_up if looked_up else None,
            "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
            "p50_ttft_ms": ttfts[len(ttfts) // 2] if ttfts else None,
            "p99_ttft_ms": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "first_turn_mean_ttft_ms": statistics.fmean(firsts) if firsts else None,
            "duration_s": duration, "errors": sorted({r.error[:200] for r in results if not r.success})}


def schedule(repeats: int) -> list[tuple[int, str]]:
    """(repeat, configuration) in run order: the two routers alternate which goes first, and the
    one-replica reference follows the first repeat."""
    order = []
    for repeat in range(repeats):
        pair = ["affinity", "default"] if repeat % 2 == 0 else ["default", "affinity"]
        order += [(repeat, name) for name in pair] + ([(0, "single_replica")] if repeat == 0 else [])
    return order


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The benchmark's keys from each configuration's runs (one per repeat, in repeat order)."""

    def hit_rate(name: str) -> float | None:
        looked_up = sum(r["looked_up_tokens"] for r in runs[name])
        return sum(r["cached_tokens"] for r in runs[name]) / looked_up if looked_up else None

    pairs = list(zip(runs["affinity"], runs["default"]))
    ratios = [a["mean_ttft_ms"] / d["mean_ttft_ms"] for a, d in pairs if a["mean_ttft_ms"] and d["mean_ttft_ms"]]
    prefill = [a["prefill_tokens"] / d["prefill_tokens"] for a, d in pairs if d["prefill_tokens"]]
    rates = {name: hit_rate(name) for name in CONFIGS}
    return {
        "affinity_hit_rate": rates["affinity"], "default_hit_rate": rates["default"],
        "single_replica_hit_rate": rates["single_replica"],
        "affinity_ttft_ratio": statistics.median(ratios) if ratios else None,
        "affinity_ttft_ratio_spread": [min(ratios), max(ratios)] if ratios else None,
        "affinity_ttft_ratios": ratios,
        "prefill_tokens_per_replica": {name: [r["prefill_tokens_per_replica"] for r in rows]
                                       for name, rows in runs.items()},
        "affinity_prefill_ratio": statistics.median(prefill) if prefill else None,
        "affinity_vs_single_hit_rate": (rates["affinity"] / rates["single_replica"]
                                        if rates["affinity"] is not None and rates["single_replica"] else None),
    }


def serve_args_for(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench serve --help`
    from k3ray.engine.config import EngineConfig

    longest = args.input_len + args.turn_len + (args.turns - 1) * (args.output_len + args.turn_len)
    # a live state slot per conversation and as many snapshot slots as sequences: room for each
    # conversation's latest prefix and each group's interval snapshots on one replica (the reference)
    stride = EngineConfig.snapshot_interval * EngineConfig.block_size
    seqs = 2 * args.conversations + args.prefix_groups * (args.input_len // stride)
    return {"model": {"model": args.model}, "server": {"max_queued_requests": -1},
            "engine": {"max_num_seqs": seqs, "max_model_len": longest + args.output_len + 2,
                       "threads": resolved_threads(args.threads)}}


def compare(args: argparse.Namespace, deploy: Callable[[dict], str]) -> dict[str, Any]:
    """Every configuration's runs on the Ray this process is connected to (deploy(app args) -> URL
    deploys the app, replacing the one before): the benchmark's keys, `runs`, `workload`, `config`."""
    serve_args = serve_args_for(args)
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for _, name in schedule(args.repeats):
        runs[name].append(measure(args, serve_args, name, deploy))
    return {
        **summarize(runs),
        "runs": runs,
        "workload": {"conversations": args.conversations, "prefix_groups": args.prefix_groups, "turns": args.turns,
                     "prefix_len": args.input_len, "turn_len": args.turn_len, "output_len": args.output_len,
                     "start_gap_s": args.start_gap_s, "requests": args.conversations * args.turns,
                     "repeats": args.repeats},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "config": {"serve_args": serve_args, "seed": args.seed, "ingress": "haproxy"},
    }


def check_arguments(args: argparse.Namespace) -> None:
    """Fills in the lengths' defaults; ValueError names a flag out of range."""
    if args.endpoint is not None:
        raise ValueError("--workload shared-prefix starts its own apps (two replicas, then one); drop --endpoint")
    args.input_len = args.input_len or PREFIX_LEN
    args.output_len = args.output_len or OUTPUT_LEN
    for name in ("conversations", "prefix_groups", "turns", "turn_len", "repeats", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prefix_groups > args.conversations:
        raise ValueError(f"--prefix-groups ({args.prefix_groups}) must not exceed --conversations "
                         f"({args.conversations})")
    if args.start_gap_s < 0:
        raise ValueError(f"--start-gap-s must be >= 0, got {args.start_gap_s}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_arguments(args)
    # lazy: Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve.isolation import free_port

    started = serve_launch.start_ray(ingress="haproxy", num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    port = free_port()
    try:
        result = compare(args, lambda app_args: serve_launch.deploy(app_args, host="127.0.0.1", port=port,
                                                                    proxy_location="HeadOnly"))
    finally:
        serve_launch.stop(owns_ray=started)
    return {**result, "machine": machine()}
