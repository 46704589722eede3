"""What one replica reports to Serve's autoscaler (K3Server.record_autoscaling_stats, every
autoscaling.metrics_interval_s): the load of an LLM replica, which is its queue of prompt tokens and
its cache, not its request count, and the time to first token it gives.

    signals = LoadSignals(window_s=30)
    admission = Admission(..., on_started=signals.observe_ttft)     # each request's first output
    signals.report(engine.get_stats(), admission.queued_tokens)    # -> {metric name: float}

The policy that reads them is serve/autoscaling.py; Serve averages each over look_back_period_s.
"""

from __future__ import annotations

import math
import time
from collections import deque

from k3ray.engine.stats import EngineStats

QUEUED_TOKENS = "k3ray_queued_prompt_tokens"  # admitted, no output yet
RUNNING = "k3ray_running_seqs"
WAITING = "k3ray_waiting_seqs"
MLA_BLOCK_USAGE = "k3ray_mla_block_usage"  # blocks held by live sequences (cached prefixes are evictable)
KDA_SLOT_USAGE = "k3ray_kda_slot_usage"  # state slots held by live sequences
CACHE_USAGE = "k3ray_cache_usage"  # the fuller of the two
TTFT_P50 = "k3ray_ttft_p50_s"
TTFT_P90 = "k3ray_ttft_p90_s"
TTFT_COUNT = "k3ray_ttft_count"  # first tokens in the window (0: the percentiles say nothing)
ITL_P90 = "k3ray_itl_p90_s"  # a disaggregated decode replica's inter-token latency
ITL_COUNT = "k3ray_itl_count"


class TTFTWindow:
    """Times to first token of the last `window_s` seconds, for percentiles."""

    def __init__(self, window_s: float, clock=time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque()  # (when observed, ttft s), oldest first

    def observe(self, ttft_s: float) -> None:
        self._samples.append((self.clock(), ttft_s))

    def recent(self) -> list[float]:
        """The window's TTFTs, sorted."""
        horizon = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        return sorted(ttft for _, ttft in self._samples)


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (q in [0, 1]) of a sorted, non-empty list."""
    assert sorted_values and 0 <= q <= 1
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


class LoadSignals:
    def __init__(self, window_s: float, clock=time.monotonic) -> None:
        self.ttft = TTFTWindow(window_s, clock)

    def observe_ttft(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def report(self, stats: EngineStats, queued_prompt_tokens: int,
               itl_s: list[float] | None = None) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica (names above); TTFT percentiles are 0
        when no request got its first token in the window (an idle replica asks for nothing). `itl_s`:
        the window's inter-token latencies, sorted (a decode replica's)."""
        cache = stats.cache
        blocks = cache["block_usage"]
        slots = cache["state_slots_live"] / cache["state_slots_total"] if cache["state_slots_total"] else 0.0
        ttfts = self.ttft.recent()
        itl = {} if itl_s is None else {ITL_P90: percentile(itl_s, 0.9) if itl_s else 0.0,
                                        ITL_COUNT: float(len(itl_s))}
        return {
            **itl,
            QUEUED_TOKENS: float(queued_prompt_tokens),
            RUNNING: float(stats.num_running),
            WAITING: float(stats.num_waiting),
            MLA_BLOCK_USAGE: float(blocks),
            KDA_SLOT_USAGE: float(slots),
            CACHE_USAGE: float(max(blocks, slots)),
            TTFT_P50: percentile(ttfts, 0.5) if ttfts else 0.0,
            TTFT_P90: percentile(ttfts, 0.9) if ttfts else 0.0,
            TTFT_COUNT: float(len(ttfts)),
        }
