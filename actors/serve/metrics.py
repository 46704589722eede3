"""Prometheus metrics of one replica, in its own CollectorRegistry (names follow vLLM's with a
`k3ray:` prefix): latency histograms observed per request, and the engine's queue, cache,
prefix-cache and speculative counters read from `get_stats()` at scrape time, plus the MoE
routers' per-expert token counts when the model runs on the Ray executor."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from k3ray.engine.outputs import FinishTally, RequestMetrics
from k3ray.engine.stats import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServeMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats],
                 expert_load: Callable[[], list[list[int]]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name}
        names = ["model_name"]
        self.ttft = Histogram("k3ray:time_to_first_token_seconds", "Time to first token", names,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(**self.labels)
        self.tpot = Histogram("k3ray:time_per_output_token_seconds", "Mean time per output token after the first",
                              names, buckets=TPOT_BUCKETS, registry=self.registry).labels(**self.labels)
        self.e2e = Histogram("k3ray:e2e_request_latency_seconds", "End-to-end latency of a request", names,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(**self.labels)
        self.finished = Counter("k3ray:request_success", "Finished requests by finish reason",
                                names + ["finished_reason"], registry=self.registry)
        self._engine = _EngineCollector(self.labels, stats)
        self.registry.register(self._engine)
        self._expert_load = expert_load

    def observe_finished(self, tally: FinishTally, m: RequestMetrics, e2e_s: float) -> None:
        reasons = set(tally.finish_reasons.values())
        for reason in reasons:
            self.finished.labels(finished_reason=reason, **self.labels).inc()
        if "abort" in reasons:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        self.e2e.observe(e2e_s)
        generated = max(tally.tokens.values(), default=0)
        if generated > 1 and m.first_token_time is not None and m.finished_time is not None:
            self.tpot.observe((m.finished_time - m.first_token_time) / (generated - 1))

    def observe_discarded(self, tokens: int) -> None:
        """Tokens the engine generated that no response carries (the one decode step of an echo-only
        request): left out of generation_tokens, so it agrees with the usage clients are told."""
        self._engine.discarded_tokens += tokens

    def observe_aborted(self, count: int) -> None:
        """Requests whose client went away (or that failed) before they finished."""
        self.finished.labels(finished_reason="abort", **self.labels).inc(count)

    async def render(self) -> tuple[bytes, str]:
        return await asyncio.to_thread(self.render_now)

    def render_now(self) -> tuple[bytes, str]:
        """The exposition text and its content type (blocking: a pipeline's expert load is fetched)."""
        self._engine.expert_load = self._expert_load() if self._expert_load is not None else None
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    def __init__(self, labels: dict[str, str], stats: Callable[[], EngineStats]) -> None:
        self.labels = labels
        self.stats = stats
        self.expert_load: list[list[int]] | None = None
        self.discarded_tokens = 0

    def describe(self):
        return []

    def collect(self):
        s = self.stats()
        keys, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"k3ray:{name}", doc, labels=keys)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"k3ray:{name}", doc, labels=keys)
            c.add_metric(values, value)
            return c

        cache = s.cache
        slots = cache["state_slots_total"]
        yield gauge("num_requests_running", "Sequences in the running batch", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled", s.num_waiting)
        yield gauge("cache_usage_perc", "Fraction of cache bytes (MLA blocks + KDA state slots) in use",
                    cache["bytes_used"] / cache["bytes_total"] if cache["bytes_total"] else 0.0)
        yield gauge("mla_block_usage_perc", "Fraction of MLA latent-cache blocks in use", cache["block_usage"])
        yield gauge("mla_blocks_used", "MLA latent-cache blocks in use", cache["blocks_used"])
        yield gauge("state_slot_usage_perc", "Fraction of KDA/conv state slots live or holding snapshots",
                    (cache["state_slots_live"] + cache["state_slots_snapshot"]) / slots if slots else 0.0)
        yield gauge("state_slots_live", "KDA/conv state slots held by running sequences", cache["state_slots_live"])
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens)", s.prefix_cache_hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits)
        yield counter("prompt_tokens", "Prompt tokens computed by prefill", s.prompt_tokens)
        yield gauge("prefill_backlog_tokens", "Prompt tokens still to prefill, short prompts", s.prefill_backlog_tokens)
        yield gauge("long_prefill_backlog_tokens", "Prompt tokens still to prefill, long prompts (their own lane)",
                    s.long_prefill_backlog_tokens)
        yield gauge("prefill_tokens_per_second", "Measured prefill rate of short prompts (0 before any)",
                    s.prefill_tok_s or 0.0)
        yield gauge("long_prefill_tokens_per_second", "Measured prefill rate of long prompts (0 before any)",
                    s.long_prefill_tok_s or 0.0)
        yield counter("generation_tokens", "Generated tokens", s.generation_tokens - self.discarded_tokens)
        yield counter("num_preemptions", "Sequences preempted for cache space", s.num_preemptions)
        yield counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed", s.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted", s.spec_accepted_tokens)
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens", s.spec_acceptance_rate)
        if self.expert_load is not None:
            load = CounterMetricFamily("k3ray:expert_load_tokens", "Tokens routed to each expert, per pipeline stage",
                                       labels=keys + ["stage", "expert"])
            for stage, counts in enumerate(self.expert_load):
                for expert, count in enumerate(counts):
                    load.add_metric(values + [str(stage), str(expert)], count)
            yield load
