"""`k3ray bench soak`: a bounded soak of an OpenAI-compatible endpoint on loopback: --num-prompts
requests (plain and streamed completions, chat) at --concurrency, every failure counted by type,
and the replica's memory sampled over the run.

Without --endpoint it starts k3ray's Serve app on 127.0.0.1 (the tiny K3 unless --model) and stops
it afterwards; memory is the resident set of the Serve replicas and their engine processes on this
machine (null for a remote endpoint). The JSON holds `requests`, `errors_by_type` (HTTP statuses as
`http_<code>`, client exceptions by class, streams that ended in an error event as `stream_error`),
`rss_mb_start`, `rss_mb_end` and `rss_mb_over_time` ([requests done, MB] pairs).

With --chaos it soaks a pipeline 2 x expert-parallel 2 server of its own for --duration seconds
while killing a random stage, shard or replica every --fault-every seconds (chaos.py).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any

import psutil

from k3ray.api_keys import CLIENT_API_KEY_HELP, client_api_key
from k3ray.bench.common import machine
from k3ray.cli_flags import add_deprecated_alias
from k3ray.threads import add_threads_argument, resolved_threads

HELP = "bounded soak on loopback: errors by type and the replica's memory over time"
KINDS = ("completion", "stream", "chat")
REPLICA_MARK = "ServeReplica:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", help="server URL (default: start k3ray's Serve app on 127.0.0.1)")
    parser.add_argument("--model", metavar="DIR", help="checkpoint served locally (default: tiny K3)")
    add_deprecated_alias(parser, "--checkpoint", "--model", dest="model")
    parser.add_argument("--served-model-name", help="the model name the endpoint serves (default: the first of "
                        "/v1/models)")
    parser.add_argument("--api-key", default=client_api_key(), help=CLIENT_API_KEY_HELP)
    parser.add_argument("--num-prompts", dest="requests", type=int, default=400, help="requests in all")
    add_deprecated_alias(parser, "--requests", "--num-prompts", dest="requests", type=int)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default 8)")
    parser.add_argument("--memory-samples", type=int, default=10, help="memory samples over the run")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--chaos", action="store_true",
                        help="start a pipeline 2 x expert-parallel 2 server and kill a random stage, shard or replica "
                        "every --fault-every seconds, for --duration seconds (instead of --num-prompts); greedy requests")
    parser.add_argument("--duration", type=float, default=600.0, help="--chaos: seconds of load (default 600)")
    parser.add_argument("--fault-every", type=float, default=30.0,
                        help="--chaos: seconds between faults, each after the last recovered (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="--chaos: which targets, in which order")
    add_threads_argument(parser, "the served replica (without --endpoint)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.chaos:
        # lazy: httpx, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
        from k3ray.actors.bench.serve.chaos import run_chaos

        return run_chaos(args)
    for flag, name in (("--num-prompts", "requests"), ("--concurrency", "concurrency"), ("--max-tokens", "max_tokens"),
                       ("--memory-samples", "memory_samples")):
        if getattr(args, name) < 1:
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, name)}")
    if args.endpoint is not None:
        return _soak(args, args.endpoint.rstrip("/"), local=False)
    # lazy: httpx, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.bench.serve.server import local_serve_app

    serve_args: dict[str, Any] = {"engine": {"max_num_seqs": max(8, args.concurrency),
                                             "threads": resolved_threads(args.threads)}}
    if args.model is not None:
        serve_args["model"] = {"model": args.model}
    with local_serve_app(serve_args) as url:
        return _soak(args, url, local=True)


def replica_rss_mb() -> float:
    """Resident MB of this machine's Serve replicas and their children (engine processes)."""
    total = 0
    for proc in psutil.process_iter(["cmdline"]):
        if REPLICA_MARK in " ".join(proc.info["cmdline"] or []):
            for p in [proc, *proc.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
    return round(total / 2**20, 1)


def _soak(args: argparse.Namespace, url: str, local: bool) -> dict[str, Any]:
    # lazy: httpx, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.bench.serve.server import server_facts

    model, _ = server_facts(url, args.served_model_name, api_key=args.api_key)
    outcomes, timeline, seconds = asyncio.run(_drive(args, url, model, local))
    errors = {kind: n for kind, n in sorted(outcomes.items()) if kind != "ok"}
    return {
        "requests": args.requests,
        "succeeded": outcomes.get("ok", 0),
        "errors_by_type": errors,
        "rss_mb_start": timeline[0][1] if local else None,
        "rss_mb_end": timeline[-1][1] if local else None,
        "rss_mb_over_time": timeline if local else None,
        "requests_per_s": round(args.requests / seconds, 2),
        "machine": machine(),
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("json", "api_key")},
    }


async def _drive(args, url: str, model: str, local: bool) -> tuple[Counter, list, float]:
    # lazy: httpx, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    import httpx

    from k3ray.actors.bench.serve.server import auth_headers

    outcomes: Counter = Counter()
    timeline = [[0, replica_rss_mb()]] if local else []
    every = max(1, args.requests // args.memory_samples)
    done = 0
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal done
        while not queue.empty():
            i = queue.get_nowait()
            outcomes[await _one(http, model, KINDS[i % len(KINDS)], i, args.max_tokens)] += 1
            done += 1
            if local and done % every == 0:
                timeline.append([done, await asyncio.to_thread(replica_rss_mb)])

    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits,
                                 headers=auth_headers(args.api_key)) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    seconds = time.monotonic() - t0
    if local and timeline[-1][0] != done:
        timeline.append([done, replica_rss_mb()])
    return outcomes, timeline, seconds


async def _one(http, model: str, kind: str, i: int, max_tokens: int) -> str:
    """One request; "ok" or the type of its failure."""
    # lazy: httpx, Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    import httpx

    sampling = {"model": model, "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
    try:
        if kind == "chat":
            body = {**sampling, "messages": [{"role": "user", "content": f"soak {i}"}]}
            r = await http.post("/v1/chat/completions", json=body)
            return "ok" if r.status_code == 200 else f"http_{r.status_code}"
        body = {**sampling, "prompt": f"soak request {i}", "stream": kind == "stream"}
        if kind == "completion":
            r = await http.post("/v1/completions", json=body)
            return "ok" if r.status_code == 200 else f"http_{r.status_code}"
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"http_{r.status_code}"
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            return "stream_unfinished"
        return "stream_error" if any('"error"' in line for line in lines) else "ok"
    except httpx.HTTPError as e:
        return type(e).__name__
