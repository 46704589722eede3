"""`k3ray bench serve --workload ramp`: autoscaling under a ramp of load, the LLM-signal policy
against Serve's ongoing-requests policy on the same requests at the same times.

For each policy a fresh Serve app (min 1, max 2 replicas, the tiny K3 unless --model) on
127.0.0.1 gets open-loop Poisson arrivals of long prompts: --base-rate for --warm-s, rising
linearly to --peak-rate over --ramp-s, held for --hold-s. The replicas Serve runs are polled
throughout. `scale_up_s` is the seconds from the start of the ramp until a second replica is
RUNNING (None if none came), `decision_s` until Serve decided to add it (the policy's part; the rest
is the replica starting); `slo_violation_frac` is the fraction of requests whose client-side TTFT
is over --ttft-slo-ms (a failed request counts as over), with the llm policy;
`baseline_slo_violation_frac` the same with the ongoing-requests policy. The llm policy aims at the
same TTFT and at --autoscale-queued-tokens per replica; the baseline at Serve's 2 ongoing requests
per replica. The two runs do not share the machine's moment: on a shared machine, --rounds N
alternates their order and reports medians.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import threading
import time
from typing import Any

import numpy as np

from k3ray.actors.serve.config import APP_NAME
from k3ray.bench.common import machine
from k3ray.actors.bench.serve import datasets
from k3ray.actors.bench.serve.client import open_session, stream_completion
from k3ray.actors.bench.serve.load import run_load
from k3ray.actors.bench.serve.server import local_serve_app, server_facts
from k3ray.threads import resolved_threads

POLICIES = ("llm", "ongoing-requests")
INPUT_LEN, OUTPUT_LEN = 2048, 8  # defaults: prompts long enough that their tokens, not their count, are the load
# delays short enough for a run of a minute, identical for both policies; no scale-in during the run
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 2.0, "downscale_delay_s": 600.0,
               "metrics_interval_s": 1.0, "look_back_period_s": 4.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--workload ramp")
    group.add_argument("--base-rate", type=float, default=0.2, help="requests/s before the ramp (default 0.2)")
    group.add_argument("--peak-rate", type=float, default=1.5, help="requests/s at the top of the ramp (default 1.5)")
    group.add_argument("--warm-s", type=float, default=10.0, help="seconds at --base-rate first (default 10)")
    group.add_argument("--ramp-s", type=float, default=15.0, help="seconds of the rise to --peak-rate (default 15)")
    group.add_argument("--hold-s", type=float, default=30.0, help="seconds at --peak-rate (default 30)")
    group.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT target (default 2000)")
    group.add_argument("--rounds", type=int, default=1,
                       help="runs of each policy, the order alternating (llm first in even rounds); figures are "
                       "medians over the rounds (default 1)")
    group.add_argument("--autoscale-queued-tokens", type=int, default=4096,
                       help="the llm policy's prompt tokens waiting per replica (default 4096)")


def rate_at(t: float, base: float, peak: float, warm_s: float, ramp_s: float) -> float:
    """Requests/s at t seconds from the start."""
    if t < warm_s:
        return base
    return peak if t >= warm_s + ramp_s else base + (peak - base) * (t - warm_s) / ramp_s


def ramp_offsets(base: float, peak: float, warm_s: float, ramp_s: float, hold_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process with rate rate_at(t) over warm_s + ramp_s + hold_s
    (thinning a process at the top rate)."""
    if not 0 < base <= peak or min(warm_s, ramp_s, hold_s) < 0:
        raise ValueError(f"rates need 0 < base <= peak and durations >= 0, got {base}, {peak}, "
                         f"{warm_s}, {ramp_s}, {hold_s}")
    rng = np.random.default_rng(seed)
    end, t, out = warm_s + ramp_s + hold_s, 0.0, []
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= end:
            return out
        if rng.random() < rate_at(t, base, peak, warm_s, ramp_s) / peak:
            out.append(t)


class ReplicaWatch:
    """The model deployment's replicas over time, polled on a thread: [(s since start, RUNNING, all)];
    a replica counts in `all` from the moment Serve decides to add it."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self.timeline: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ReplicaWatch:
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        from ray import serve  # lazy: Ray stays out of `k3ray bench --help` (it loads every benchmark)

        while not self._stop.is_set():
            states = serve.status().applications[APP_NAME].deployments["K3Server"].replica_states
            self.timeline.append((time.perf_counter() - self.start, states.get("RUNNING", 0), sum(states.values())))
            self._stop.wait(self.period_s)

    def first_time_with(self, replicas: int, running: bool = True) -> float | None:
        """When `replicas` were first RUNNING (running) or decided on (not running); None if never."""
        return next((t for t, up, decided in self.timeline if (up if running else decided) >= replicas), None)

    def replica_seconds(self) -> float:
        """Running replicas integrated over the polled time (what the run cost)."""
        return sum((t1 - t0) * up for (t0, up, _), (t1, _, _) in zip(self.timeline, self.timeline[1:]))


def serve_args(args: argparse.Namespace, policy: str, input_len: int, output_len: int) -> dict[str, Any]:
    autoscaling = {**AUTOSCALING, "autoscale_policy": policy, "autoscale_ttft_ms": args.ttft_slo_ms,
                   "autoscale_queued_tokens": args.autoscale_queued_tokens}
    return {"model": {"model": args.model}, "autoscaling": autoscaling,
            # requests wait in the replicas, where both policies can see them
            "server": {"max_queued_requests": -1, "max_ongoing_requests": 256, "max_queued_tokens": 0,
                       "max_queue_wait_s": 0},
            "engine": {"max_num_seqs": args.max_num_seqs or 16, "max_model_len": input_len + output_len + 2,
                       "threads": resolved_threads(args.threads)}}


def run_policy(args: argparse.Namespace, policy: str, offsets: list[float], make_requests) -> dict[str, Any]:
    """One policy's run on a fresh app: its replicas over time and its requests' TTFTs."""
    input_len, output_len = args.input_len, args.output_len
    with local_serve_app(serve_args(args, policy, input_len, output_len), ingress=args.ingress) as url:
        model, tokenizer_info = server_facts(url, args.served_model_name)
        requests = make_requests(tokenizer_info, len(offsets), input_len, output_len)

        async def load():
            async with open_session(None, args.timeout) as session:
                return await run_load(lambda r: stream_completion(session, url, model, r), requests, offsets)

        with ReplicaWatch() as watch:
            results, duration = asyncio.run(load())
    slo_s = args.ttft_slo_ms / 1000
    ttfts = [r.ttft for r in results if r.success]
    over = sum(1 for r in results if not r.success or r.ttft > slo_s)
    scaled, decided = watch.first_time_with(2), watch.first_time_with(2, running=False)
    return {
        "policy": policy,
        "scale_up_s": None if scaled is None else round(scaled - args.warm_s, 2),
        "decision_s": None if decided is None else round(decided - args.warm_s, 2),  # the policy's part of it
        "slo_violation_frac": over / len(results),
        "requests": len(results), "failed": sum(1 for r in results if not r.success),
        "mean_ttft_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
        "p90_ttft_ms": 1000 * float(np.percentile(ttfts, 90)) if ttfts else None,
        "duration_s": duration,
        "replica_seconds": round(watch.replica_seconds(), 1),
        "replicas": [(round(t, 2), up, decided) for i, (t, up, decided) in enumerate(watch.timeline)
                     if i == 0 or (up, decided) != watch.timeline[i - 1][1:]],  # the changes only
        "serve_args": serve_args(args, policy, input_len, output_len),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.endpoint is not None:
        raise ValueError("--workload ramp starts its own app per policy (it compares two autoscaling policies); "
                         "drop --endpoint")
    args.input_len = INPUT_LEN if args.input_len is None else args.input_len
    args.output_len = OUTPUT_LEN if args.output_len is None else args.output_len
    if min(args.input_len, args.output_len, args.rounds) < 1 or args.ttft_slo_ms <= 0:
        raise ValueError(f"--prompt-tokens, --max-tokens and --rounds must be >= 1 and --ttft-slo-ms > 0, got "
                         f"{args.input_len}, {args.output_len}, {args.rounds}, {args.ttft_slo_ms}")
    offsets = ramp_offsets(args.base_rate, args.peak_rate, args.warm_s, args.ramp_s, args.hold_s, args.seed)
    if not offsets:
        raise ValueError("the ramp holds no request: raise the rates or the durations")

    def make_requests(tokenizer_info: dict, n: int, input_len: int, output_len: int):
        token_range = datasets.ordinary_token_range(tokenizer_info)  # the same tokenizer, so the same requests
        return datasets.random_requests(n, input_len, output_len, token_range, args.range_ratio, args.seed)

    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for round_ in range(args.rounds):  # alternating, so neither policy always meets the machine's later state
        for policy in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:
            runs[policy].append(run_policy(args, policy, offsets, make_requests))
    llm, baseline = runs["llm"], runs["ongoing-requests"]
    return {
        "scale_up_s": median_of(llm, "scale_up_s"),
        "slo_violation_frac": median_of(llm, "slo_violation_frac"),
        "baseline_slo_violation_frac": median_of(baseline, "slo_violation_frac"),
        "baseline_scale_up_s": median_of(baseline, "scale_up_s"),
        "decision_s": median_of(llm, "decision_s"),
        "baseline_decision_s": median_of(baseline, "decision_s"),
        "replica_seconds": median_of(llm, "replica_seconds"),
        "baseline_replica_seconds": median_of(baseline, "replica_seconds"),
        "ttft_slo_ms": args.ttft_slo_ms,
        "runs": runs,
        "machine": machine(),
        "config": {name: getattr(args, name) for name in (
            "workload", "model", "ingress", "input_len", "output_len", "range_ratio", "base_rate", "peak_rate",
            "warm_s", "ramp_s", "hold_s", "ttft_slo_ms", "autoscale_queued_tokens", "rounds", "seed", "threads")},
    }


def median_of(runs: list[dict], key: str) -> float | None:
    """The median of runs' `key`; None (never scaled) counts as the largest, and a median that
    falls on it is None."""
    values = [math.inf if run[key] is None else run[key] for run in runs]
    middle = statistics.median(values)
    return None if math.isinf(middle) else middle
