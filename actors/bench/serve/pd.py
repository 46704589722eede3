"""`k3ray bench serve --workload pd`: prefill/decode disaggregation against colocated replicas with the
same number of replicas in total — decode streams' inter-token latency while long prompts arrive, the
greedy outputs of both apps, and what each handoff carried and took.

Two apps in turn on one local Ray instance (haproxy ingress, Serve's default routing), the same
requests each: `colocated` (2 K3Server replicas, each prefilling and decoding) and `disaggregated`
(1 K3Prefill + 1 K3Server decode replica). --decode-streams streams (--prompt-tokens random tokens,
up to --max-tokens tokens, EOS ignored) start; once each has its first token and they have decoded
alone for a moment (the quiet ITL), --long-prompts prompts of --long-prompt-tokens tokens arrive at
once (default 2: one per colocated replica). The window runs from their arrival until the first of
them completes (every long prompt is in flight throughout: a replica done with its own would else
swamp the percentile with its fast gaps); the streams' gaps ending in it give each app's ITL p99,
and `pd_itl_p99_ratio` = disaggregated / colocated. The streams are closed at the window's end, the
long prompts run to completion. `pd_outputs_identical`: each long prompt's output is equal in both
apps and each stream's shorter output is a prefix of the other's. The decode replica's handoff
counters (K3Server.handoff_stats) taken around the long prompts (nothing else starts meanwhile) give
`handoff_bytes_per_token_ratio` = (state + latent bytes) / the formula (per handoff: tokens sent x
len(mla_layer_ids) x mla_latent_dim x dtype bytes + the KDA/conv state slot) and
`handoff_ms_per_1k_tokens` = transfer time (the prefill side's first token to the handoff written on
the decode side) per 1,000 prompt tokens; `handoff_latent_share_sent_during_prefill` = the latent
bytes that crossed in parts while later chunks ran / all latent bytes. --pin-cores pins each replica
(its actor and engine processes) to a core of its own, round robin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from k3ray.bench.common import machine
from k3ray.actors.bench.serve.client import RequestResult, open_session, stream_completion
from k3ray.actors.bench.serve.datasets import BenchRequest, ordinary_token_range, random_requests
from k3ray.actors.bench.serve.server import server_facts, wait_healthy
from k3ray.threads import resolved_threads

STREAM_PROMPT, STREAM_TOKENS = 32, 65536  # defaults: the streams are closed once the window ends
LONG_TOKENS, LONG_OUTPUT = 32768, 8
QUIET_S = 2.0  # the streams decode alone this long before the long prompts arrive
APP = "k3ray-pd-bench"
APPS = {"colocated": {"autoscaling": {"min_replicas": 2, "max_replicas": 2}},
        "disaggregated": {"autoscaling": {"min_replicas": 1, "max_replicas": 1},
                          "disaggregation": {"prefill_replicas": 1}}}
DEPLOYMENTS = {"colocated": ("K3Server", "K3Server"), "disaggregated": ("K3Prefill", "K3Server")}  # pinning order


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--workload pd", f"each decode stream has --prompt-tokens tokens (default "
                                      f"{STREAM_PROMPT}) and at most --max-tokens (default {STREAM_TOKENS})")
    group.add_argument("--decode-streams", type=int, default=4, help="decode streams running (default 4)")
    group.add_argument("--long-prompts", type=int, default=2,
                       help="long prompts arriving at once while the streams decode (default 2)")
    group.add_argument("--long-prompt-tokens", type=int, default=LONG_TOKENS,
                       help=f"tokens of each long prompt (default {LONG_TOKENS})")
    group.add_argument("--pin-cores", action="store_true",
                       help="pin each replica (actor and engine processes) to a core of its own (default: off)")


def serve_args(args: argparse.Namespace, app: str) -> dict[str, Any]:
    """One app's ServeArgs groups: room for every stream's and long prompt's whole length, and no
    admission bound (the long prompts must run, not get 429)."""
    longest = max(args.input_len + args.output_len, args.long_prompt_tokens + LONG_OUTPUT) + 2
    return {"model": {"model": args.model}, "routing": {"request_router": "default"},
            "server": {"max_queued_requests": -1, "max_queued_tokens": 0, "max_queue_wait_s": 0},
            "engine": {"max_num_seqs": args.max_num_seqs or args.decode_streams + args.long_prompts + 2,
                       "max_model_len": longest, "threads": resolved_threads(args.threads)},
            **APPS[app]}


def handoff_formula_bytes(model: str | None, dtype: str, tokens_sent: int, handoffs: int) -> int:
    """What `handoffs` handoffs carrying `tokens_sent` latent rows in all should weigh: the MLA latents
    per token plus one KDA/conv state slot per handoff."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.default_model import checkpoint_dir
    from k3ray.engine.core.cache_manager import state_slot_bytes
    from k3ray.weights.checkpoint_dir import read_config

    config = read_config(checkpoint_dir(model))
    torch_dtype = getattr(torch, dtype)
    per_token = len(config.mla_layer_ids) * config.mla_latent_dim * torch_dtype.itemsize
    return tokens_sent * per_token + handoffs * state_slot_bytes(config, torch_dtype)


def chunk_gaps(result: RequestResult) -> list[tuple[float, float]]:
    """(the client time a chunk arrived, the gap before it) of each chunk after the first."""
    t, out = result.start_time + result.ttft, []
    for gap in result.itl:
        t += gap
        out.append((t, gap))
    return out


def percentile_ms(values: list[float], p: float) -> float | None:
    return 1000 * float(np.percentile(values, p)) if values else None


async def workload(url: str, model: str, streams: list[BenchRequest], longs: list[BenchRequest],
                   timeout: float, api_key: str | None, handoff_stats: Callable[[], dict | None]) -> dict:
    """The streams, then the long prompts at once: every result, the window's bounds (client
    perf_counter seconds) and the handoff counters just before the long prompts and after them."""
    stop = asyncio.Event()
    started = [asyncio.Event() for _ in streams]

    def watch(index: int) -> Callable[[RequestResult], bool]:
        def on_chunk(_: RequestResult) -> bool:
            started[index].set()
            return stop.is_set()
        return on_chunk

    async with open_session(None, timeout, api_key) as session:
        stream_tasks = [asyncio.create_task(stream_completion(session, url, model, r, on_chunk=watch(i)))
                        for i, r in enumerate(streams)]
        for event, task in zip(started, stream_tasks):
            await asyncio.wait([asyncio.create_task(event.wait()), task], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                raise RuntimeError(f"a decode stream ended before the long prompts came: {task.result().error}")
        await asyncio.sleep(QUIET_S)
        before = await asyncio.to_thread(handoff_stats)
        window_start = time.perf_counter()
        long_tasks = [asyncio.create_task(stream_completion(session, url, model, r)) for r in longs]
        await asyncio.wait(long_tasks, return_when=asyncio.FIRST_COMPLETED)
        window_end = time.perf_counter()
        stop.set()
        stream_results = await asyncio.gather(*stream_tasks)
        long_results = await asyncio.gather(*long_tasks)
        after = await asyncio.to_thread(handoff_stats)
    return {"streams": stream_results, "longs": long_results, "window": (window_start, window_end),
            "handoff": (before, after)}


def summarize(app: str, measured: dict) -> dict[str, Any]:
    """One app's figures: the streams' ITL in the window and before it, the long prompts' latencies."""
    start, end = measured["window"]
    streams, longs = measured["streams"], measured["longs"]
    failed = [r.error[:300] for r in [*streams, *longs] if not r.success]
    per_stream, window_gaps, quiet_gaps = [], [], []
    for r in streams:
        gaps = [(t, g) for t, g in chunk_gaps(r) if t <= end]
        inside = [g for t, g in gaps if t >= start]
        window_gaps += inside
        quiet_gaps += [g for t, g in gaps if t < start]
        per_stream.append({"tokens": r.output_tokens, "window_gaps": len(inside),
                           "window_itl_p50_ms": percentile_ms(inside, 50),
                           "window_itl_max_ms": percentile_ms(inside, 100), "closed_by_client": r.stopped})
    return {
        "app": app, "failed": failed,
        "window_s": end - start,
        "itl_p99_ms": percentile_ms(window_gaps, 99), "itl_p50_ms": percentile_ms(window_gaps, 50),
        "itl_max_ms": percentile_ms(window_gaps, 100), "window_gaps": len(window_gaps),
        "quiet_itl_p99_ms": percentile_ms(quiet_gaps, 99), "quiet_itl_p50_ms": percentile_ms(quiet_gaps, 50),
        "streams_cover_window": all(r.stopped for r in streams),  # none ran out of tokens before the window ended
        "streams": per_stream,
        "long_ttft_s": [round(r.ttft, 3) for r in longs], "long_e2el_s": [round(r.latency, 3) for r in longs],
    }


def handoff_figures(before: dict, after: dict, long_prompts: list[BenchRequest], model: str | None,
                    dtype: str) -> dict[str, Any]:
    """The long prompts' handoffs: the counters' growth over them, against the formula."""
    delta = {k: after[k] - before[k] for k in ("handoffs", "retries", "prompt_tokens", "tokens_sent", "state_bytes",
                                               "latent_bytes", "prefill_s", "transfer_s", "parts", "part_bytes")}
    if delta["handoffs"] != len(long_prompts) or delta["prompt_tokens"] != sum(r.prompt_len for r in long_prompts):
        raise RuntimeError(f"the decode replica counted {delta} over {len(long_prompts)} long prompts: something "
                           "else ran meanwhile")
    formula = handoff_formula_bytes(model, dtype, delta["tokens_sent"], delta["handoffs"])
    measured = delta["state_bytes"] + delta["latent_bytes"]
    transports = {name: n - before.get("transports", {}).get(name, 0) for name, n in after["transports"].items()}
    return {**delta, "transports": {name: n for name, n in transports.items() if n}, "measured_bytes": measured,
            "formula_bytes": formula,
            "bytes_per_prompt_token": measured / delta["prompt_tokens"],
            "bytes_ratio": measured / formula,
            "ms_per_1k_tokens": 1000 * delta["transfer_s"] / (delta["prompt_tokens"] / 1000),
            "early_share": delta["part_bytes"] / delta["latent_bytes"] if delta["latent_bytes"] else None}


def outputs_identical(colocated: dict, disaggregated: dict) -> tuple[bool, dict]:
    """Long prompts: equal outputs; streams (closed at different points): one output a prefix of the
    other. (verdict, the characters compared per stream)."""
    longs = all(a.generated_text == b.generated_text and a.success and b.success
                for a, b in zip(colocated["longs"], disaggregated["longs"]))
    compared, streams = [], True
    for a, b in zip(colocated["streams"], disaggregated["streams"]):
        short, long = sorted((a.generated_text, b.generated_text), key=len)
        streams &= bool(short) and long.startswith(short)
        compared.append(len(short))
    return longs and streams, {"long_prompts_equal": longs, "stream_prefixes_equal": streams,
                               "stream_chars_compared": compared}


def wait_serving(url: str, app: str, timeout_s: float = 600.0) -> None:
    """Wait until every deployment of `app` runs and a request goes through (a disaggregated app's
    decode replica answers /health before its prefill pool is up)."""
    # lazy: Ray stays out of `k3ray bench --help` (it loads every benchmark)
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while (status := serve.status().applications.get(app)) is None or status.status.value != "RUNNING":
        if status is not None and status.status.value == "DEPLOY_FAILED":
            raise RuntimeError(f"the app {app} failed to deploy: {status.message}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app {app} did not come up within {timeout_s:.0f} s")
        time.sleep(1.0)
    wait_healthy(url, timeout_s)


def pin_replicas(app: str, deployments: tuple[str, ...]) -> dict[str, list[int]]:
    """Pin each replica of `app` (in `deployments` order: the replica process, its engine process and
    every thread) to one core, round robin over this process's allowed cores -> {deployment#i: [core]}.
    Only Ray processes started under this process are looked at (other people's apps are left alone)."""
    # lazy: psutil (Ray's dependency) stays out of `k3ray bench --help`
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    mine = psutil.Process().children(recursive=True)
    pinned: dict[str, list[int]] = {}
    index = 0
    for deployment in dict.fromkeys(deployments):
        tag = f"ServeReplica:{app}:{deployment}"
        replicas = [p for p in mine if tag in " ".join(_cmdline(p))]
        if len(replicas) != deployments.count(deployment):
            raise RuntimeError(f"{deployments.count(deployment)} {tag} processes expected under this process, "
                               f"found {len(replicas)}")
        for n, replica in enumerate(replicas):
            core = cores[index % len(cores)]
            index += 1
            for process in [replica, *replica.children(recursive=True)]:
                for thread in process.threads():
                    with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                        os.sched_setaffinity(thread.id, {core})
            pinned[f"{deployment}#{n}"] = [core]
    return pinned


def _cmdline(process) -> list[str]:
    import psutil  # lazy: see pin_replicas

    try:
        return process.cmdline()
    except psutil.Error:  # a process that ended meanwhile, or not ours to read
        return []


def measure_app(args: argparse.Namespace, app: str, deploy: Callable[[dict], str],
                requests_for: Callable[[dict], tuple[list[BenchRequest], list[BenchRequest]]]) -> tuple[dict, dict]:
    """Deploy one app, warm it, pin it if asked, run the workload: (its summary, the raw results).
    requests_for(/tokenizer_info) -> (the streams, the long prompts)."""
    # lazy: Ray stays out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve.config import ServeArgs
    from k3ray.actors.serve.driver_calls import call_deployment

    app_args = serve_args(args, app)
    url = deploy(app_args)
    wait_serving(url, APP)
    model, info = server_facts(url, args.served_model_name, api_key=args.api_key)
    streams, longs = requests_for(info)
    warm = random_requests(1, args.input_len, 4, ordinary_token_range(info), seed=args.seed + 999_999)
    asyncio.run(_warm_up(url, model, warm, args.timeout, args.api_key))
    pinned = pin_replicas(APP, DEPLOYMENTS[app]) if args.pin_cores else None
    def handoff_stats() -> dict | None:
        return call_deployment(APP, "K3Server", "handoff_stats")

    measured = asyncio.run(workload(url, model, streams, longs, args.timeout, args.api_key, handoff_stats))
    summary = {**summarize(app, measured), "pinned_cores": pinned}
    before, after = measured["handoff"]
    if after is not None:
        summary["handoff"] = handoff_figures(before, after, longs, args.model,
                                             ServeArgs.model_validate(app_args).model.dtype)
    return summary, measured


async def _warm_up(url: str, model: str, requests: list[BenchRequest], timeout: float, api_key: str | None) -> None:
    async with open_session(None, timeout, api_key) as session:
        for request in requests:
            result = await stream_completion(session, url, model, request)
            if not result.success:
                raise RuntimeError(f"the warm-up request failed: {result.error}")


def compare(args: argparse.Namespace, deploy: Callable[[dict], str], delete: Callable[[], None]) -> dict[str, Any]:
    """Both apps in turn (`deploy(serve_args) -> url` deploys app APP, `delete()` removes it), the same
    requests each -> the benchmark's figures."""
    def requests(info: dict) -> tuple[list[BenchRequest], list[BenchRequest]]:
        token_range = ordinary_token_range(info)
        streams = random_requests(args.decode_streams, args.input_len, args.output_len, token_range, seed=args.seed)
        longs = random_requests(args.long_prompts, args.long_prompt_tokens, LONG_OUTPUT, token_range,
                                seed=args.seed + 1)
        return streams, longs

    load_before = os.getloadavg()
    runs, raw = {}, {}
    for app in APPS:
        try:
            runs[app], raw[app] = measure_app(args, app, deploy, requests)
        finally:
            delete()
    colocated, disaggregated = runs["colocated"], runs["disaggregated"]
    identical, detail = outputs_identical(raw["colocated"], raw["disaggregated"])
    ratio = None  # none from a run with a failed request: its window could have closed early
    if colocated["itl_p99_ms"] and disaggregated["itl_p99_ms"] is not None and not (
            colocated["failed"] or disaggregated["failed"]):
        ratio = disaggregated["itl_p99_ms"] / colocated["itl_p99_ms"]
    handoff = disaggregated.get("handoff", {})
    return {
        "pd_itl_p99_ratio": ratio,
        "pd_outputs_identical": identical,
        "handoff_bytes_per_token_ratio": handoff.get("bytes_ratio"),
        "handoff_ms_per_1k_tokens": handoff.get("ms_per_1k_tokens"),
        "handoff_latent_share_sent_during_prefill": handoff.get("early_share"),
        "outputs": detail,
        "runs": runs,
        "workload": {"decode_streams": args.decode_streams, "stream_prompt_tokens": args.input_len,
                     "stream_max_tokens": args.output_len, "long_prompts": args.long_prompts,
                     "long_prompt_tokens": args.long_prompt_tokens, "long_output_tokens": LONG_OUTPUT,
                     "quiet_s": QUIET_S, "pin_cores": args.pin_cores},
        "machine": {**machine(), "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "config": {"serve_args": {app: serve_args(args, app) for app in APPS}, "seed": args.seed,
                   "ingress": "haproxy"},
    }


def check(args: argparse.Namespace) -> None:
    if args.endpoint is not None:
        raise ValueError("--workload pd starts its own apps (colocated, then disaggregated); drop --endpoint")
    args.input_len = STREAM_PROMPT if args.input_len is None else args.input_len
    args.output_len = STREAM_TOKENS if args.output_len is None else args.output_len
    for name in ("decode_streams", "long_prompts", "long_prompt_tokens", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    check(args)
    # lazy: Ray and the Serve app stay out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve.isolation import free_port

    started = serve_launch.start_ray(ingress="haproxy", num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    port = free_port()
    try:
        return compare(args, lambda app_args: serve_launch.deploy(app_args, host="127.0.0.1", port=port, name=APP,
                                                                  proxy_location="HeadOnly"),
                       lambda: serve_launch.delete_app(APP))
    finally:
        serve_launch.stop(owns_ray=started, name=APP)
