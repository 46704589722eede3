"""Admission by work: one replica's waiting requests are bounded by their prompt tokens and by the
wait they can expect, not only by their count (Serve's max_queued_requests). A request beyond
either bound is turned away at once with a 429 and a Retry-After of about the expected wait.

    admission = Admission(max_queued_tokens=65536, max_queue_wait_s=30, retry_after_s=1)
    admission.check(prompt_tokens)                 # a 429 APIError when full (before a stream starts)
    ticket = admission.admit(prompt_tokens)        # in the queue
    admission.started(ticket)                      # its first output: it left the queue
    admission.finish(ticket)                       # always (idempotent)

`on_started(wait_s)` hears each request's wait from admission to its first output (its time to
first token in this replica).

A request waits from admission to its first output. The replica's throughput is measured as the
prompt tokens that left the queue per second of time the queue was not empty (a decaying average),
so an idle replica does not look slow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from k3ray.actors.openai_errors import APIError, retry_after_header

MEMORY_S = 60.0  # the throughput average forgets older work with this time constant
MAX_RETRY_AFTER_S = 60.0


@dataclass
class Ticket:
    tokens: int
    admitted_s: float = 0.0
    waiting: bool = True


class Admission:
    def __init__(self, max_queued_tokens: int | None, max_queue_wait_s: float | None, retry_after_s: float,
                 clock=time.monotonic, on_started: Callable[[float], None] | None = None) -> None:
        self.max_queued_tokens = max_queued_tokens
        self.max_queue_wait_s = max_queue_wait_s
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.on_started = on_started
        self.queued_tokens = 0
        self._served_tokens = 0.0  # decayed: tokens that left the queue
        self._busy_s = 0.0  # decayed: seconds the queue was not empty
        self._last = clock()

    def throughput(self) -> float | None:
        """Prompt tokens per second leaving the queue while it is busy; None before any measurement."""
        self._advance()
        return self._served_tokens / self._busy_s if self._busy_s > 0 and self._served_tokens > 0 else None

    def expected_wait_s(self, tokens: int = 0) -> float:
        rate = self.throughput()
        return 0.0 if rate is None else (self.queued_tokens + tokens) / rate

    def check(self, tokens: int) -> None:
        """A 429 APIError if the queue cannot take a request of `tokens` prompt tokens now (an empty
        queue takes any request: a bound below one prompt must not refuse it forever)."""
        self._advance()
        if self.queued_tokens > 0:
            reason = None
            if self.max_queued_tokens is not None and self.queued_tokens + tokens > self.max_queued_tokens:
                reason = f"{self.queued_tokens} prompt tokens are waiting (limit {self.max_queued_tokens})"
            wait = self.expected_wait_s(tokens)
            if reason is None and self.max_queue_wait_s is not None and wait > self.max_queue_wait_s:
                reason = f"the expected wait is {wait:.1f} s (limit {self.max_queue_wait_s:g} s)"
            if reason is not None:
                retry = min(MAX_RETRY_AFTER_S, max(self.retry_after_s, math.ceil(wait)))
                raise APIError(429, f"The server is busy: {reason}; retry after {retry_after_header(retry)} s.",
                               None, "queue_full", {"Retry-After": retry_after_header(retry)})

    def admit(self, tokens: int) -> Ticket:
        """Queue a request (check() it first): it waits until started() or finish()."""
        self._advance()
        self.queued_tokens += tokens
        return Ticket(tokens, self._last)

    def started(self, ticket: Ticket) -> None:
        if ticket.waiting:
            self._advance()
            self._served_tokens += ticket.tokens
            self._leave(ticket)
            if self.on_started is not None:
                self.on_started(self._last - ticket.admitted_s)

    def finish(self, ticket: Ticket) -> None:
        if ticket.waiting:
            self._advance()
            self._leave(ticket)

    def _leave(self, ticket: Ticket) -> None:
        ticket.waiting = False
        self.queued_tokens -= ticket.tokens
        assert self.queued_tokens >= 0

    def _advance(self) -> None:
        """Decay the averages to now, counting the time since the last event as busy if anything waited."""
        now = self.clock()
        dt, self._last = now - self._last, now
        decay = math.exp(-dt / MEMORY_S)
        self._served_tokens *= decay
        self._busy_s = self._busy_s * decay + (dt if self.queued_tokens > 0 else 0.0)
