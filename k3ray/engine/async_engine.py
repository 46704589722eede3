"""Streaming front of the engine for servers: a background step loop and one async iterator per
request.

    engine = AsyncEngine(LLMEngine(LocalExecutor(model), EngineConfig()))
    async for out in engine.generate(prompt_ids, SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].token_ids)      # of params.output_kind; the last one has out.finished

Engine steps run in a worker thread, so the event loop stays responsive; requests and aborts are
queued and applied between steps (the engine itself is single-threaded).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from contextlib import aclosing

from k3ray.engine.core.sequence import Request
from k3ray.engine.disagg.handoff import Handoff
from k3ray.engine.llm_engine import LLMEngine
from k3ray.engine.outputs import RequestOutput, follow, latest, merge_deltas
from k3ray.engine.process.engine_info import EngineInfo
from k3ray.engine.stats import EngineStats
from k3ray.engine.step_or_abort import step_or_abort
from k3ray.sampling_params import RequestOutputKind, SamplingParams
from k3ray.vision import ProcessedMedia


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending: list[Request] = []
        self._aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stats = engine.get_stats()  # as of the last step, as EngineClient's

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None, request_id: str,
                       media: Seq[ProcessedMedia] | None = None, *, export_from: int | None = None,
                       export_parts: bool = False, handoff: Handoff | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs (of params.output_kind: cumulative, deltas, or the final one) as tokens arrive, the
        last with finished=True. Raises ValueError before
        the first output if the request cannot run; leaving the iteration early aborts it. `media`:
        see LLMEngine.make_request (it is encoded in the step loop, off the event loop), as are
        export_from, export_parts and handoff (prefill/decode disaggregation)."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        request = self.engine.make_request(request_id, prompt, params, media=media, export_from=export_from,
                                           export_parts=export_parts, handoff=handoff)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._pending.append(request)
        self._start()
        # closing this generator closes follow() at once, which aborts the request
        combine = merge_deltas if request.params.output_kind is RequestOutputKind.DELTA else latest
        async with aclosing(follow(queue, lambda: self.abort(request_id), combine)) as outputs:
            async for out in outputs:
                yield out

    async def held_prefix_tokens(self, prompt: str | Seq[int], media: Seq[ProcessedMedia] | None = None) -> int:
        """LLMEngine.held_prefix_tokens (lookups only: safe beside a step, as make_request is)."""
        return self.engine.held_prefix_tokens(prompt, media)

    def abort(self, request_id: str) -> None:
        """Stop a request (applied before the next step); its stream ends with finish_reason 'abort'."""
        if request_id in self._streams:
            self._aborts.append(request_id)
            self._start()

    def get_stats(self) -> EngineStats:
        """As of the engine's last step (or abort): requests queued since are not in it yet."""
        return self._stats

    @property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            self._streams.pop(request_id).put_nowait(RuntimeError("the engine was shut down"))
        self.engine.close()

    # the loop ---------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _apply_queued(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            queued = next((r for r in self._pending if r.request_id == request_id), None)
            if queued is not None:
                self._pending.remove(queued)
                self.engine.enqueue(queued)
            final = self.engine.abort_request(request_id)
            if final is not None:
                self._deliver(final)
        if aborts:
            self._stats = self.engine.get_stats()
        pending, self._pending = self._pending, []
        for request in pending:
            try:
                self.engine.enqueue(request)
            except ValueError as e:
                self._streams.pop(request.request_id).put_nowait(e)

    def _deliver(self, out: RequestOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    async def _run(self) -> None:
        while True:
            self._apply_queued()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            step = await asyncio.to_thread(step_or_abort, self.engine)
            self._stats = self.engine.get_stats()
            for request_id in step.aborted:  # the step failed: its requests' streams end with the cause
                self._streams.pop(request_id).put_nowait(step.error)
            for out in step.outputs:
                self._deliver(out)
            for request_id, error in self.engine.take_failed():  # a grammar that could not be compiled
                self._streams.pop(request_id).put_nowait(error)
            await asyncio.sleep(0)
