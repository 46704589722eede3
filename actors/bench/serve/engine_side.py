"""The same requests on the in-process engine, at most `concurrency` in flight: the throughput the
server is compared against (served_vs_engine_tok_s)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from k3ray.engine.llm_engine import LLMEngine
from k3ray.actors.bench.serve.datasets import BenchRequest
from k3ray.sampling_params import RequestOutputKind, SamplingParams


def params_for(request: BenchRequest) -> SamplingParams:
    """What the benchmark client asks the server for: greedy, exactly output_len tokens, as deltas
    (what the server asks its engine for)."""
    return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


def run_on_engine(engine: LLMEngine, requests: Sequence[BenchRequest], concurrency: int | None) -> dict[str, Any]:
    """Closed loop: a new request enters as soon as one finishes, like the client's semaphore."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 or None, got {concurrency}")
    limit = concurrency or len(requests)
    pending = list(enumerate(requests))
    in_flight: set[str] = set()
    output_tokens = 0
    start = time.perf_counter()
    try:
        while pending or in_flight:
            while pending and len(in_flight) < limit:
                i, request = pending.pop(0)
                engine.add_request(f"bench-{i}", list(request.prompt_ids), params_for(request))
                in_flight.add(f"bench-{i}")
            for out in engine.step():
                if out.request_id in in_flight:
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if out.finished:
                        in_flight.discard(out.request_id)
    except BaseException:
        for request_id in in_flight:
            engine.abort_request(request_id)
        raise
    duration = time.perf_counter() - start
    return {"duration": duration, "completed": len(requests), "total_output_tokens": output_tokens,
            "output_throughput": output_tokens / duration, "request_throughput": len(requests) / duration}
