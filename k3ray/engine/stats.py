"""Engine counters and timings for metrics: queue sizes, cache use, prefix hits, speculative
acceptance, TTFT / TPOT, and the prefill backlog and measured rates a server's admission reads."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from k3ray.engine.outputs import RequestMetrics
from k3ray.engine.rates import Rate

WINDOW = 1000  # recent requests kept for percentiles


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_steps: int
    num_preemptions: int
    prompt_tokens: int  # computed by prefill (prefix hits excluded)
    generation_tokens: int
    cache: dict[str, int | float]
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_verifications: int
    num_finished: int
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_mean_s: float | None
    media_items_encoded: int = 0  # images / videos through the vision encoder
    cached_prefixes: frozenset[bytes] = frozenset()  # CacheManager.resumable_prefixes()
    # admission's inputs: tokens still to prefill per lane (short / long prompts, Scheduler.backlog),
    # each lane's measured prefill rate and the decode rate (tokens per second of step time; None
    # before any); they hold the requests queued before `as_of` (time.monotonic(): the last step's start)
    prefill_backlog_tokens: int = 0
    long_prefill_backlog_tokens: int = 0
    prefill_tok_s: float | None = None
    long_prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    prefill_step_s: float | None = None  # a prefill step's mean time (with the work before it)
    as_of: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted(self) -> float:
        """Accepted drafts per verification (the bonus token not counted)."""
        return self.spec_accepted_tokens / self.spec_verifications if self.spec_verifications else 0.0


class StatsCollector:
    def __init__(self) -> None:
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_verifications = 0
        self.num_finished = 0
        self.media_items_encoded = 0
        self.prefill_rate = Rate()  # short prompts
        self.long_prefill_rate = Rate()
        self.decode_rate = Rate()
        self.prefill_step_rate = Rate()  # steps that computed prompt tokens, per second
        self.ttft: deque[float] = deque(maxlen=WINDOW)
        self.tpot: deque[float] = deque(maxlen=WINDOW)

    def finished(self, metrics: RequestMetrics, num_output_tokens: int) -> None:
        self.num_finished += 1
        if metrics.ttft is not None:
            self.ttft.append(metrics.ttft)
            if num_output_tokens > 1 and metrics.finished_time is not None:
                self.tpot.append((metrics.finished_time - metrics.first_token_time) / (num_output_tokens - 1))

    def observe_step(self, seconds: float, prefill_tokens: int, long_prefill_tokens: int, decode_tokens: int) -> None:
        self.prefill_rate.observe(prefill_tokens, seconds)
        self.long_prefill_rate.observe(long_prefill_tokens, seconds)
        self.decode_rate.observe(decode_tokens, seconds)
        self.prefill_step_rate.observe(int(prefill_tokens + long_prefill_tokens > 0), seconds)

    def snapshot(self, **live) -> EngineStats:
        ttft = sorted(self.ttft)
        return EngineStats(
            num_steps=self.num_steps,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_verifications=self.spec_verifications,
            num_finished=self.num_finished,
            media_items_encoded=self.media_items_encoded,
            ttft_mean_s=statistics.fmean(ttft) if ttft else None,
            ttft_p50_s=ttft[len(ttft) // 2] if ttft else None,
            ttft_p99_s=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            tpot_mean_s=statistics.fmean(self.tpot) if self.tpot else None,
            prefill_tok_s=self.prefill_rate.per_s,
            long_prefill_tok_s=self.long_prefill_rate.per_s,
            decode_tok_s=self.decode_rate.per_s,
            prefill_step_s=None if self.prefill_step_rate.per_s is None else 1 / self.prefill_step_rate.per_s,
            **live,
        )
