"""Admission by work, in two lanes: a replica turns a request away at once (429 with a Retry-After of
about the wait, and the reason) when the prompt tokens ahead of it in its lane, or the wait they
predict, pass the bounds. Prompts longer than the engine's long_prefill_token_threshold take the
long lane: they are judged against each other only, so one long prompt never fills the queue for
short requests (the engine gives them their share of every step; engine/core/scheduler.py), and a
request that alone exceeds max_queued_tokens is taken whenever nothing waits in its lane.

    limits = AdmissionLimits(max_queued_tokens=65536, max_queue_wait_s=30, retry_after_s=1,
                             long_prompt_tokens=16384, prefill_chunk_tokens=1024)   # the last two: EngineInfo's
    admission = Admission(limits, engine.get_stats)
    admission.check([512, 300])                    # per-prompt token counts; a 429 APIError when full
    ticket = admission.admit([512, 300])           # in the queue: ticket.predicted_wait_s
    admission.started(ticket)                      # its first output: it left the queue
    admission.finish(ticket)                       # always (idempotent)

What is ahead comes from the engine itself (EngineStats: the tokens each lane still has to prefill,
what preempted sequences recompute included, and their prefill rates measured over the steps that
did such work, so idle time and aborted requests do not skew them), plus the requests admitted
since those stats were taken. The wait is ahead / rate, plus the request's own prompt at that rate
but at least a prefill step (measured too) per chunk of its longest prompt and one for its last
partial block; `on_started(wait_s)` hears each
request's real wait from admission to its first output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from k3ray.actors.openai.errors import APIError, retry_after_header
from k3ray.engine.stats import EngineStats

MAX_RETRY_AFTER_S = 60.0
SHORT, LONG = "short", "long"


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_tokens: int | None  # prompt tokens waiting in the short lane; None: no bound
    max_queue_wait_s: float | None  # expected wait in either lane; None: no bound
    retry_after_s: float  # the least Retry-After of a 429
    long_prompt_tokens: int  # a prompt longer than this takes the long lane (the engine's threshold)
    prefill_chunk_tokens: int  # the most of one prompt an engine step computes


@dataclass
class Ticket:
    tokens: int
    lane: str
    admitted_s: float
    predicted_wait_s: float | None  # None: no rate measured yet
    waiting: bool = True


class Admission:
    def __init__(self, limits: AdmissionLimits, stats: Callable[[], EngineStats], clock=time.monotonic,
                 on_started: Callable[[float], None] | None = None) -> None:
        """stats: the engine's latest EngineStats (its `as_of` on `clock`)."""
        self.limits = limits
        self.stats = stats
        self.clock = clock
        self.on_started = on_started
        self._waiting: list[Ticket] = []  # admitted, no output yet

    def lane(self, prompts: Sequence[int]) -> str:
        return LONG if max(prompts, default=0) > self.limits.long_prompt_tokens else SHORT

    def ahead(self, lane: str) -> int:
        """Prompt tokens the lane still has to prefill: the engine's count, plus requests admitted since."""
        stats = self.stats()
        known = stats.long_prefill_backlog_tokens if lane == LONG else stats.prefill_backlog_tokens
        return known + sum(t.tokens for t in self._waiting if t.lane == lane and t.admitted_s > stats.as_of)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to prefill in both lanes (the autoscaler's queue signal)."""
        return self.ahead(SHORT) + self.ahead(LONG)

    def expected_wait_s(self, prompts: Sequence[int]) -> float | None:
        """Seconds until a request of these prompts would have its first token; None without a rate.
        The tokens ahead go at the lane's rate; its own prompts then take at least one step per chunk."""
        lane = self.lane(prompts)
        stats = self.stats()
        rate = stats.long_prefill_tok_s if lane == LONG else stats.prefill_tok_s
        if not rate:
            return None
        steps = math.ceil(max(prompts, default=0) / self.limits.prefill_chunk_tokens) + 1  # + its last partial block
        return self.ahead(lane) / rate + max(sum(prompts) / rate, steps * (stats.prefill_step_s or 0.0))

    def check(self, prompts: Sequence[int]) -> None:
        """A 429 APIError if the lane of a request with these prompt token counts cannot take it now
        (a lane with nothing ahead takes any request: a bound below one prompt must not refuse it forever)."""
        lane, tokens = self.lane(prompts), sum(prompts)
        ahead = self.ahead(lane)
        if ahead == 0:
            return
        limits = self.limits
        wait = self.expected_wait_s(prompts)
        reason = None
        if lane == SHORT and limits.max_queued_tokens is not None and ahead + tokens > limits.max_queued_tokens:
            alone = tokens > limits.max_queued_tokens
            reason = (f"this request's {tokens} prompt tokens exceed the queue's limit of {limits.max_queued_tokens} "
                      "on their own, so it is taken only when no prompt waits" if alone else
                      f"{ahead} prompt tokens are waiting (limit {limits.max_queued_tokens})")
        elif wait is not None and limits.max_queue_wait_s is not None and wait > limits.max_queue_wait_s:
            where = (f"{ahead} tokens of long prompts (over {limits.long_prompt_tokens} tokens) are ahead in "
                     "their own lane" if lane == LONG else f"{ahead} prompt tokens are ahead")
            reason = f"{where}: the expected wait is {wait:.1f} s (limit {limits.max_queue_wait_s:g} s)"
        if reason is not None:
            retry = min(MAX_RETRY_AFTER_S, max(limits.retry_after_s, math.ceil(wait or 0)))
            raise APIError(429, f"The server is busy: {reason}; retry after {retry_after_header(retry)} s.",
                           None, "queue_full", {"Retry-After": retry_after_header(retry)})

    def admit(self, prompts: Sequence[int]) -> Ticket:
        """Queue a request (check() it first): it waits until started() or finish()."""
        ticket = Ticket(sum(prompts), self.lane(prompts), self.clock(), self.expected_wait_s(prompts))
        self._waiting.append(ticket)
        return ticket

    def started(self, ticket: Ticket) -> None:
        if ticket.waiting:
            self._leave(ticket)
            if self.on_started is not None:
                self.on_started(self.clock() - ticket.admitted_s)

    def finish(self, ticket: Ticket) -> None:
        if ticket.waiting:
            self._leave(ticket)

    def _leave(self, ticket: Ticket) -> None:
        ticket.waiting = False
        self._waiting.remove(ticket)
