"""Prefill/decode disaggregation, the decode replica's side: each request's prompt runs on a prefill
replica (K3Prefill, serve/prefill_server.py), whose handoff — the MLA latent rows this replica's
cache lacks, the KDA / conv state after the prompt, the first token and the sampler's state
(k3ray/engine/disagg/handoff.py) — this replica's engine imports and continues from, streaming the output.
It orchestrates, as Ray Serve LLM's decode server does:

    held = await engine.held_prefix_tokens(prompt)       # whole blocks of the prompt already cached here
    parts, handoff = prefill.options(stream=True).prefill.remote(prompt, params, media, held, ...)
    async for out in engine.generate(prompt, params, request_id, media, handoff=handoff.joined(parts)): ...

Overlap: a prefill replica whose engine reads its caches in its own process (not a Ray pipeline)
streams the latent rows of each prompt chunk but the last as it is computed, so they cross while the
later chunks run, on to this replica's engine process too (EngineClient.send_handoff_part: it keeps
them and joins them with the handoff the import brings); only the last chunk's rows, the state and
the first token travel after the first token.

Between pipeline replicas whose stages hold the same layers, each prefill stage's part goes straight to
the decode stage that holds those layers (no replica process in between): through Ray's object store
("stage-direct") or pulled from the prefill stage's memory over Ray's NIXL tensor transport
("stage-direct-nixl", pipeline/stage_records.py); otherwise the handoff travels through the object
store as one flat numpy array through the two replicas ("host", read without a copy; an engine process
of this replica gets it over its socket).

Failures: a prefill replica lost mid-request (or its engine gone), a handoff lost in transit, a
handoff the engine can no longer write (the held prefix evicted meanwhile: the retry sends everything)
are retried up to `attempts` prefills in all, then end in ModelUnavailableError (a 503 with
Retry-After); a bad request (ValueError from the prefill replica) is a 400 at once. Requests with
several sequences (n, best_of) run here whole. Same interface as EngineClient / AsyncEngine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from contextlib import aclosing

import ray
from ray.serve.handle import DeploymentHandle

from k3ray.actors.pipeline.stage_records import PartOwnerLostError
from k3ray.actors.serve.ingress_routing import block_chain
from k3ray.actors.serve.load_signals import TTFTWindow
from k3ray.engine.disagg.handoff import Handoff, HandoffMismatchError, HandoffPart
from k3ray.engine.outputs import RequestOutput
from k3ray.engine.process.engine_client import EngineClient
from k3ray.engine.process.errors import ModelUnavailableError
from k3ray.sampling_params import SamplingParams
from k3ray.vision import ProcessedMedia

logger = logging.getLogger(__name__)


class HandoffStats:
    """What this replica's handoffs measured: counts, bytes by kind, prompt tokens, prefill and
    transfer time (for metrics and `k3ray bench serve --workload pd`)."""

    def __init__(self) -> None:
        self.handoffs = 0
        self.transports: dict[str, int] = {}  # handoffs by transport (Handoff.transport)
        self.retries = 0
        self.prompt_tokens = 0  # over the handoffs
        self.tokens_sent = 0  # latent rows carried (prompt tokens the receiver lacked)
        self.state_bytes = 0
        self.latent_bytes = 0
        self.prefill_s = 0.0  # prefill side: arrival to first token
        self.transfer_s = 0.0  # the prefill side's first token to the handoff written here
        self.parts = 0  # HandoffParts: latent rows sent while the prompt's later chunks ran
        self.part_bytes = 0  # their latent bytes (in latent_bytes too)

    def observe_part(self, part: HandoffPart) -> None:
        size = part.nbytes()
        self.parts += 1
        self.part_bytes += size
        self.latent_bytes += size

    def observe(self, handoff: Handoff, transport: str, transfer_s: float) -> None:
        """A final handoff (its parts, observed as they came, hold the rest of its latent rows)."""
        sizes = handoff.unpack().nbytes()
        self.handoffs += 1
        self.transports[transport] = self.transports.get(transport, 0) + 1
        self.prompt_tokens += handoff.num_prompt_tokens
        self.tokens_sent += handoff.num_prompt_tokens - handoff.start
        self.state_bytes += sizes["state"]
        self.latent_bytes += sizes["mla_latent"]
        self.prefill_s += handoff.prefill_seconds
        self.transfer_s += transfer_s

    def as_dict(self) -> dict:
        return {**vars(self), "transports": dict(self.transports)}


class DisaggregatedEngine:
    def __init__(self, engine, prefill: DeploymentHandle, block_size: int, attempts: int,
                 media_placeholder_token_id: int | None, itl_window_s: float) -> None:
        self.engine = engine
        self.prefill = prefill
        self.block_size = block_size
        self.attempts = attempts
        self.placeholder = media_placeholder_token_id
        self.stats = HandoffStats()
        self.itl = TTFTWindow(itl_window_s)  # inter-token latencies of this replica's streams

    # the engine interface ------------------------------------------------------------------------
    @property
    def info(self):
        return self.engine.info

    def get_stats(self):
        return self.engine.get_stats()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None, request_id: str,
                       media: Seq[ProcessedMedia] | None = None) -> AsyncIterator[RequestOutput]:
        params = SamplingParams() if params is None else params
        if params.num_sequences != 1 or isinstance(prompt, str):
            stream = self.engine.generate(prompt, params, request_id, media)
        else:
            stream = self._disaggregated(list(prompt), params, request_id, media)
        last = None
        async with aclosing(stream) as outputs:
            async for out in outputs:
                now = time.monotonic()
                tokens = sum(len(c.token_ids) for c in out.outputs)
                if last is not None and tokens:
                    self.itl.observe((now - last) / tokens)
                last = now if tokens else last
                yield out

    async def _disaggregated(self, prompt: list[int], params: SamplingParams, request_id: str,
                             media: Seq[ProcessedMedia] | None) -> AsyncIterator[RequestOutput]:
        held, failure = None, None
        for attempt in range(self.attempts):
            if held is None:
                held = await self.engine.held_prefix_tokens(prompt, media)
            asked = time.monotonic()
            try:
                final, parts = await self._prefill(prompt, params, media, held, f"{request_id}-p{attempt}", request_id)
            except (ValueError, ray.exceptions.TaskCancelledError):
                raise
            except (ModelUnavailableError, ray.exceptions.RayError) as e:  # a prefill replica or its result lost
                failure = e
                self.stats.retries += 1
                logger.warning("request %s: prefill attempt %d failed: %s: %s", request_id, attempt + 1,
                               type(e).__name__, e)
                continue
            transport = final.transport
            handoff = await asyncio.to_thread(final.joined, parts) if parts else final
            if transport != "host" and isinstance(self.engine, EngineClient):  # its engine process is no Ray worker
                try:
                    handoff = await asyncio.to_thread(lambda h=handoff: h.materialized().pack())
                except (PartOwnerLostError, ray.exceptions.RayError) as e:  # a prefill stage gone since
                    failure = e
                    self.stats.retries += 1
                    continue
            started = False
            try:
                async with aclosing(self.engine.generate(prompt, params, request_id, media, handoff=handoff)) as outs:
                    async for out in outs:
                        if not started:
                            started = True
                            self.stats.observe(final, transport, time.monotonic() - asked - final.prefill_seconds)
                        yield out
                return
            except HandoffMismatchError as e:  # the prefix it left out was evicted here: send everything
                if started:
                    raise
                failure, held = e, 0
                self.stats.retries += 1
        raise ModelUnavailableError(f"no prefill replica could run the prompt in {self.attempts} attempts; the last "
                                    f"failure: {type(failure).__name__}: {failure}")

    async def _prefill(self, prompt: list[int], params: SamplingParams, media, held: int, request_id: str,
                       engine_request_id: str) -> tuple[Handoff, list[HandoffPart]]:
        """One prefill on a replica chosen by prefix affinity over the prompt's block hashes -> its final
        handoff and the parts to join it with. The parts stream in while its later chunks run: an engine
        process gets each at once (and joins them with the handoff its import brings: none are
        returned), an engine here gets them joined by the caller."""
        chain = block_chain(prompt, self.block_size, self.placeholder)
        response = self.prefill.options(stream=True).prefill.remote(
            prompt, params, list(media) if media else None, held, request_id, prefix_hashes=chain)
        forward = isinstance(self.engine, EngineClient)
        parts, final = [], None
        try:
            async for item in response:
                if not isinstance(item, HandoffPart):
                    final = item
                    continue
                self.stats.observe_part(item)
                if forward:
                    self.engine.send_handoff_part(engine_request_id, item)
                else:
                    parts.append(item)
            if isinstance(final, BaseException):  # its engine refused it: the error as that replica saw it
                raise final
            assert isinstance(final, Handoff), f"the prefill of {request_id} ended with {type(final).__name__}"
        except BaseException:
            response.cancel()  # the client left (or the call failed): the prefill replica aborts it
            if forward:
                self.engine.send_handoff_part(engine_request_id, None)  # the parts sent so far go
            raise
        return final, parts
