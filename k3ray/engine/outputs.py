"""What the engine hands back per request (vLLM's RequestOutput / CompletionOutput shapes): the
whole output so far, or (SamplingParams.output_kind DELTA) only what is new since the request's
previous output — new token ids, text and logprobs; the prompt's logprobs arrive the same way.
OutputAccumulator turns deltas back into the whole output, for a caller that wants it.

    acc = OutputAccumulator()
    for delta in deltas: acc.add(delta)
    final = acc.output()
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k3ray.engine.disagg.handoff import Handoff, HandoffPart


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "handoff" (prefill only)
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
    handoff: Handoff | None = None  # a prefill-only request's caches and first token, in its final output
    handoff_parts: list[HandoffPart] = field(default_factory=list)  # its latent rows sent early (delta outputs)


@dataclass
class _Growing:
    """One completion, deltas appended."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        if c.text:
            self.text_parts.append(c.text)
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += c.logprobs
        self.cumulative_logprob = c.cumulative_logprob
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    def output(self) -> CompletionOutput:
        return CompletionOutput(self.index, "".join(self.text_parts), list(self.token_ids), self.cumulative_logprob,
                                None if self.logprobs is None else list(self.logprobs), self.finish_reason,
                                self.stop_reason)


class OutputAccumulator:
    """One request's delta outputs in (`add`: O(the delta)), its whole output out (`output`: O(length))."""

    def __init__(self) -> None:
        self._last: RequestOutput | None = None
        self._handoff_parts: list[HandoffPart] = []
        self._prompt_logprobs: list[PositionLogprobs | None] | None = None
        self._completions: dict[int, _Growing] = {}

    def add(self, delta: RequestOutput) -> None:
        self._last = delta
        self._handoff_parts += delta.handoff_parts
        if delta.prompt_logprobs is not None:
            if self._prompt_logprobs is None:
                self._prompt_logprobs = []
            self._prompt_logprobs += delta.prompt_logprobs
        for c in delta.outputs:
            self._completions.setdefault(c.index, _Growing(c.index)).add(c)

    def output(self) -> RequestOutput:
        last = self._last
        assert last is not None, "no output added yet"
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                             None if self._prompt_logprobs is None else list(self._prompt_logprobs),
                             [self._completions[i].output() for i in sorted(self._completions)], last.finished,
                             last.metrics, last.handoff, list(self._handoff_parts))


@dataclass
class FinishTally:
    """What a server's metrics need of one request's delta outputs: each completion's tokens and finish reason."""

    tokens: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str | None] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.tokens[c.index] = self.tokens.get(c.index, 0) + len(c.token_ids)
            self.finish_reasons[c.index] = c.finish_reason


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of a request as one."""
    acc = OutputAccumulator()
    acc.add(first)
    acc.add(then)
    return acc.output()


def latest(_: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive cumulative outputs as one: the later."""
    return then


async def follow(stream: asyncio.Queue, abort: Callable[[], None],
                 combine: Callable[[RequestOutput, RequestOutput], RequestOutput] = latest
                 ) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue (RequestOutputs, or an exception to raise) up to the
    finished one; a consumer that fell behind gets the outputs it missed combined into one
    (`merge_deltas` for deltas, `latest` for cumulative outputs); leaving early aborts."""
    finished = False
    try:
        while not finished:
            item = await stream.get()
            while not stream.empty() and isinstance(item, RequestOutput):
                following = stream.get_nowait()
                item = combine(item, following) if isinstance(following, RequestOutput) else following
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()
