"""The prefill pool of a disaggregated app: K3Prefill replicas run prompts (chunked, prefix-cache
aware, the same engine as K3Server) and stream each one's handoff (k3ray/engine/disagg/handoff.py: the
latent rows of each chunk as it is computed, then the rest with the state and first token) to the
decode replica that asked (serve/disaggregation.py). No HTTP: only decode replicas call it,
through a deployment handle routed by prefix affinity over the prompt's block hashes. It reports
its own load (queued prompt tokens, TTFT) to the autoscaler, for the prefill pool's own policy. A
replica whose engine process died ends itself at the next prefill (the decode side retries that
elsewhere), and Serve starts another.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import ray
from ray import serve

from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import start_replica_engine
from k3ray.actors.serve.load_signals import LoadSignals
from k3ray.actors.serve.request_routing import PREFIXES_STAT
from k3ray.engine.disagg.handoff import Handoff, HandoffPart
from k3ray.engine.process.engine_client import EngineClient
from k3ray.engine.process.errors import ModelUnavailableError
from k3ray.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@serve.deployment(name="K3Prefill")
class K3Prefill:
    async def __init__(self, args: dict) -> None:
        self.args = ServeArgs.model_validate(args)
        placement_group = ray.util.get_current_placement_group() if self.args.distributed else None
        self.engine, self.executor, _ = await start_replica_engine(self.args, placement_group)
        self.load_signals = LoadSignals(window_s=self.args.autoscaling.look_back_period_s)
        logger.info("K3Prefill ready: %s", type(self.executor or self.engine).__name__)

    async def prefill(self, prompt: list[int], params: SamplingParams, media, export_from: int, request_id: str,
                      prefix_hashes: list[bytes] | None = None
                      ) -> AsyncIterator[HandoffPart | Handoff | ValueError | ModelUnavailableError]:
        """Run the prompt to its first token, streaming (a Serve generator): the latent rows of each
        prompt chunk but the last as a HandoffPart once it is computed (from `export_from` on, where
        the engine reads them here), then the Handoff of the rest, each packed for the object store.
        A request the engine refuses (ValueError) or a model that cannot step (ModelUnavailableError)
        ends the stream as that error, so the decode side raises it as such. `prefix_hashes` is the
        prefix-affinity router's (serve/request_routing.py)."""
        final = None
        try:
            deltas = replace(params, output_kind=RequestOutputKind.DELTA)
            stream = self.engine.generate(prompt, deltas, request_id, media, export_from=export_from,
                                          export_parts=True)
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    for part in out.handoff_parts:
                        yield part.pack()
                    final = out
        except (ValueError, ModelUnavailableError) as e:
            self._leave_if_engine_dead()
            yield e
            return
        assert final is not None and final.handoff is not None, f"request {request_id} ended without a handoff"
        if final.metrics.ttft is not None:
            self.load_signals.observe_ttft(final.metrics.ttft)
        yield final.handoff.pack()

    def _leave_if_engine_dead(self) -> None:
        """An engine process that died never comes back: end this replica now, so the caller's attempt
        fails with ActorDiedError, which takes the replica out of the callers' routers at once, and Serve
        starts another. Kept alive until its health checks fail, it would fail every request routed here
        at once, and as the least loaded replica it would draw them all."""
        if isinstance(self.engine, EngineClient) and not self.engine.alive:
            logger.error("K3Prefill: engine process exit code %s; this replica ends", self.engine.process.poll())
            os._exit(1)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The prefill pool's load: prompt tokens waiting in the engine, and the TTFT it gives."""
        stats = self.engine.get_stats()
        return self.load_signals.report(stats, stats.prefill_backlog_tokens + stats.long_prefill_backlog_tokens)

    def record_routing_stats(self) -> dict:
        """The prefixes this replica's cache can resume from, for prefix-affinity routing."""
        return {PREFIXES_STAT: self.engine.get_stats().cached_prefixes}

    async def check_health(self) -> None:
        if isinstance(self.engine, EngineClient):
            if not self.engine.alive:
                raise RuntimeError(f"engine process exit code {self.engine.process.poll()}")
            return
        report = await asyncio.to_thread(self.executor.health)
        if not report["healthy"] and report.get("state") != "recovering":
            raise RuntimeError(f"pipeline {report.get('state')}: {report.get('cause')}")

    async def __del__(self) -> None:
        if hasattr(self, "engine"):
            await self.engine.shutdown()
        if getattr(self, "executor", None) is not None:
            await asyncio.to_thread(self.executor.shutdown)
