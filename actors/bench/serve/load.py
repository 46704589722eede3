"""Open-loop load: requests arrive on a schedule (Poisson, or gamma-distributed gaps for other
burstiness) whatever the server's state, optionally capped at a number in flight.

Gaps between arrivals are Gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean 1 / rate
for any burstiness; burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular
(vLLM's convention). An infinite rate sends everything at t = 0; with a cap of C in flight that
is a closed loop at concurrency C.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from k3ray.actors.bench.serve.client import RequestResult
from k3ray.actors.bench.serve.datasets import BenchRequest


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of n requests arrives (the first at 0)."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or n == 0:
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


async def run_load(send: Callable[[BenchRequest], Awaitable[RequestResult]], requests: Sequence[BenchRequest],
                   offsets: Sequence[float], max_concurrency: int | None = None) -> tuple[list[RequestResult], float]:
    """Send every request at its offset (waiting for a free slot when capped); (results in request
    order, wall seconds from the first arrival to the last completion)."""
    if len(offsets) != len(requests):
        raise ValueError(f"{len(offsets)} arrival offsets for {len(requests)} requests")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        arrived = time.perf_counter()
        async with slots:
            result = await send(request)
        result.queue_time = result.start_time - arrived
        return result

    results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
    return list(results), time.perf_counter() - start
