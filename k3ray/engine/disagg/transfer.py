"""Prefill/decode disaggregation inside an engine: a request's handoff settings checked, the handoffs a
decode engine waits to write into its caches, and the handoffs (and parts) a prefill engine reads out of
its caches after a step."""

from __future__ import annotations

import time
from collections import deque

from k3ray.engine.core.cache_manager import CacheManager
from k3ray.engine.core.scheduler import Scheduler, SchedulerOutput
from k3ray.engine.core.sequence import Request, Sequence
from k3ray.engine.disagg.handoff import Handoff, HandoffMismatchError, HandoffPart, latent_rows
from k3ray.engine.execution.executor import Executor
from k3ray.engine.output_processor import OutputProcessor
from k3ray.engine.stats import StatsCollector
from k3ray.sampling_params import RequestOutputKind


def check_handoff(request: Request, block_size: int, export_from: int | None, export_parts: bool,
                  handoff: Handoff | None) -> None:
    """ValueError (HandoffMismatchError for a handoff of another prompt) unless the settings fit the request."""
    if export_from is not None and handoff is not None:
        raise ValueError("a request either hands off its prefill (export_from) or continues one (handoff)")
    if export_parts and (export_from is None or request.params.output_kind is not RequestOutputKind.DELTA):
        raise ValueError("export_parts needs export_from and DELTA outputs (each output carries the parts new "
                         "since the previous one)")
    if handoff is not None and handoff.latent_from != handoff.start:
        raise HandoffMismatchError(f"the handoff of {handoff.request_id!r} carries rows from {handoff.latent_from}, "
                                   f"not from {handoff.start}: join the parts sent before it first")
    if request.params.num_sequences != 1:
        raise ValueError(f"disaggregated prefill runs one sequence a request; this one asks "
                         f"{request.params.num_sequences} (n / best_of)")
    n = len(request.prompt_token_ids)
    if export_from is not None and not (0 <= export_from < n and export_from % block_size == 0):
        raise ValueError(f"export_from={export_from} must be a multiple of block_size={block_size} below the "
                         f"prompt's {n} tokens")
    if handoff is not None and handoff.prompt_token_ids != request.prompt_token_ids:
        raise HandoffMismatchError(f"the handoff of request {handoff.request_id!r} is for another prompt "
                                   f"({handoff.num_prompt_tokens} tokens; this one has {n})")


class HandoffTransfer:
    def __init__(self, scheduler: Scheduler, cache: CacheManager, executor: Executor,
                 output_processor: OutputProcessor, stats: StatsCollector) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self.executor = executor
        self.output_processor = output_processor
        self.stats = stats
        self.waiting: deque[Request] = deque()  # handed-off requests waiting for room in the caches

    def import_waiting(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Write the waiting handoffs that fit into the caches, oldest first; their first tokens go out now.
        A handoff that cannot be written (its prefix evicted here since it was asked, a layout that does not
        match) fails its request -> (the requests imported, the requests failed)."""
        imported, failed = [], []
        while self.waiting:
            request = self.waiting[0]
            seq, handoff = request.seqs[0], request.handoff_in
            try:
                if not self.scheduler.admit_handoff(seq, handoff.start):
                    break
                rows = latent_rows(seq.block_table, handoff.start, seq.prompt_len, self.cache.block_size)
                self.executor.write_handoff(handoff.unpack().records, seq.state_slot, rows)
            except Exception as e:  # noqa: BLE001 - this request fails (a mismatch: its sender retries), the rest go on
                self.waiting.popleft()
                self.scheduler.free(seq)
                failed.append((request, e))
                continue
            self.waiting.popleft()
            request.handoff_in = None
            self.cache.register_blocks(seq)
            self._continue_from(seq, handoff)
            imported.append(request)
        return imported, failed

    def _continue_from(self, seq: Sequence, handoff: Handoff) -> None:
        """Take the prefill side's first token as if sampled here: its sampler state, then the same
        append path (stop checks, detokenizer, grammar) as a token sampled here."""
        request = seq.request
        if handoff.generator_state is not None:
            seq.generator.set_state(handoff.generator_state)
        if request.prompt_logprobs is not None and handoff.prompt_logprobs is not None:
            request.prompt_logprobs = list(handoff.prompt_logprobs)
        if seq.grammar is not None:
            seq.grammar.accept(handoff.first_token)
        self.stats.generation_tokens += 1
        if self.output_processor.append(seq, handoff.first_token, handoff.first_logprobs):
            self.scheduler.free(seq)

    def export(self, out: SchedulerOutput) -> set[Request]:
        """Prefill-only sequences that sampled their first token this step end with their handoff;
        those exporting parts whose chunk computed rows this step send them -> the requests that did."""
        parted = set()
        for sc in out.seqs:
            seq, request = sc.seq, sc.seq.request
            if request.export_from is None:
                continue
            if not sc.num_new_tokens:
                if request.export_parts and sc.end > request.rows_sent:
                    rows = latent_rows(seq.block_table, request.rows_sent, sc.end, self.cache.block_size)
                    request.handoff_parts_out.append(HandoffPart(
                        request.request_id, request.rows_sent, sc.end, self.executor.read_handoff(seq.state_slot, rows)))
                    request.rows_sent = sc.end
                    parted.add(request)
                continue
            rows = latent_rows(seq.block_table, request.rows_sent, seq.prompt_len, self.cache.block_size)
            request.handoff_out = Handoff(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                start=request.export_from,
                records=self.executor.read_handoff(seq.state_slot, rows),
                first_token=seq.token_ids[seq.prompt_len],
                first_logprobs=seq.output_logprobs[0] if seq.output_logprobs else None,
                generator_state=seq.generator.get_state() if seq.generator is not None else None,
                prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
                prefill_seconds=time.monotonic() - request.metrics.arrival_time,
                rows_from=None if request.rows_sent == request.export_from else request.rows_sent,
            )
            if not seq.finished:
                self.output_processor.hand_off(seq)
        return parted
