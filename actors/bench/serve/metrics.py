"""vLLM `bench serve` metrics from per-request results, under vLLM's key names.

TPOT = (E2EL - TTFT) / (output tokens - 1) per request with more than one output token; ITL is
every gap between streamed chunks; goodput counts requests meeting every SLO given
(`ttft`, `tpot`, `e2el` in ms; a one-token request has TPOT 0) per second. The peak output
rate counts streamed chunks per wall-clock second, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from k3ray.actors.bench.serve.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput entries look like ttft:500, tpot:50 or e2el:2000 (ms), got {spec!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name} needs a number of milliseconds, got {spec!r}") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {spec!r}")
    return slos


def percentile_name(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def tpot(result: RequestResult) -> float:
    return (result.latency - result.ttft) / (result.output_tokens - 1) if result.output_tokens > 1 else 0.0


def _summary(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"{percentile_name(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _peaks(done: Sequence[RequestResult]) -> tuple[float, int]:
    """(most chunks in one wall-clock second, most requests in flight at once)."""
    if not done:
        return 0.0, 0
    t0 = min(r.start_time for r in done)
    buckets: dict[int, int] = {}
    for r in done:
        t = r.start_time + r.ttft
        for gap in [0.0, *r.itl]:
            t += gap
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    # ends sort before starts at the same instant: intervals are half-open
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return float(max(buckets.values())), peak


def calculate_metrics(results: Sequence[RequestResult], duration: float, percentiles: Sequence[float] = (99,),
                      goodput: dict[str, float] | None = None) -> dict[str, Any]:
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    done = [r for r in results if r.success]
    values = {"ttft": [r.ttft for r in done], "tpot": [tpot(r) for r in done if r.output_tokens > 1],
              "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done]}
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    good = None
    if goodput:
        seconds = {name: ms / 1000 for name, ms in goodput.items()}
        per_request = {"ttft": lambda r: r.ttft, "tpot": tpot, "e2el": lambda r: r.latency}
        good = sum(all(per_request[name](r) <= limit for name, limit in seconds.items()) for r in done)
    peak_tok_s, peak_requests = _peaks(done)
    metrics: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": None if good is None else good / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": peak_tok_s,
        "max_concurrent_requests": peak_requests,
    }
    for name in LATENCY_METRICS:
        metrics |= _summary(name, values[name], percentiles)
    return metrics


def per_request_lists(results: Sequence[RequestResult]) -> dict[str, list]:
    """vLLM's detailed per-request fields (failed requests included, with zeros)."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }
