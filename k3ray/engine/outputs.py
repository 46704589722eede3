"""What the engine hands back per request (vLLM's RequestOutput / CompletionOutput shapes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """log p(token) under the raw model distribution (fp32 log-softmax); rank 1 is the argmax."""

    logprob: float
    rank: int


# one position: token id -> Logprob (the top-n plus the chosen token)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) for TTFT / TPOT."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))


async def follow(stream: asyncio.Queue, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue (cumulative RequestOutputs, or an exception to raise) up
    to the finished one; a consumer that fell behind gets only the latest; leaving early aborts."""
    finished = False
    try:
        while not finished:
            item = await stream.get()
            while not stream.empty() and isinstance(item, RequestOutput):
                item = stream.get_nowait()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
