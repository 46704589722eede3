"""The engine in a process of its own, driven from a server's event loop — vLLM V1's EngineCore
split: the model's step loop and the server's request handling no longer share one GIL, so HTTP
work does not stall steps and steps do not stall HTTP work. Same interface as AsyncEngine.

    client = EngineClient.start(functools.partial(build, args))   # the factory runs in the child
    async for out in client.generate(prompt_ids, SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].token_ids)      # of params.output_kind; the last one has out.finished
    await client.shutdown()

Outputs cross the socket as the engine's deltas (a request's prompt only in its first); a caller
that asked for cumulative outputs gets them built here. A reader and a sender thread do the
blocking socket I/O, so the event loop never waits on the engine. A consumer that falls behind
gets the outputs it missed combined into one. If the engine process dies, every
open stream fails with a RuntimeError naming its exit code, `alive` turns False, and new requests
are refused with the same error.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from contextlib import aclosing
from dataclasses import replace
from multiprocessing.connection import Connection

from k3ray.engine.disagg.handoff import Handoff, HandoffPart
from k3ray.engine.outputs import OutputAccumulator, RequestOutput, follow, latest, merge_deltas
from k3ray.engine.process.engine_core_proc import WirePrompts
from k3ray.engine.process.engine_info import EngineInfo
from k3ray.engine.process.errors import ModelUnavailableError
from k3ray.engine.pipe import recv, send
from k3ray.engine.stats import EngineStats
from k3ray.sampling_params import RequestOutputKind, SamplingParams
from k3ray.vision import ProcessedMedia

SHUTDOWN_GRACE_S = 10.0


class EngineDeadError(ModelUnavailableError):
    """The engine process is gone (or was shut down): no request can run until it is replaced."""


class EngineClient:
    def __init__(self, process: subprocess.Popen, conn: Connection, info: EngineInfo, stats: EngineStats) -> None:
        self.process = process
        self.info = info
        self._conn = conn
        self._stats = stats
        self._prompts = WirePrompts()
        self._streams: dict[str, asyncio.Queue] = {}
        self._replies: dict[int, asyncio.Future] = {}  # held_prefix_tokens calls awaiting the engine
        self._calls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: RuntimeError | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # messages for the sender thread; None ends it
        # blocking socket I/O off the event loop: a large media message never stalls it, and the
        # reader keeps draining outputs while the sender waits for the engine to take a message
        self._reader = threading.Thread(target=self._read_loop, name="engine-client-reader", daemon=True)
        self._sender = threading.Thread(target=self._send_loop, name="engine-client-sender", daemon=True)
        self._reader.start()
        self._sender.start()

    @classmethod
    def start(cls, factory: Callable[[], object], startup_timeout_s: float | None = None) -> EngineClient:
        """Start the engine process and wait (blocking) until `factory()` has built its LLMEngine.
        factory must be picklable; an error it raises is raised here."""
        parent_end, child_end = socket.socketpair()
        # started off the working directory: `python -m` puts it first on sys.path, and a k3ray
        # checkout there would shadow the installed package (its kernels, actors, evals live beside it)
        process = subprocess.Popen([sys.executable, "-m", "k3ray.engine.process.engine_core_proc", str(child_end.fileno()),
                                    str(os.getpid())], pass_fds=(child_end.fileno(),), cwd=tempfile.gettempdir())
        child_end.close()
        conn = Connection(parent_end.detach())
        try:
            send(conn, factory)
            message = _wait_ready(conn, process, startup_timeout_s)
        except BaseException:
            _stop(process, conn, grace_s=0)
            raise
        if message[0] == "failed":
            _stop(process, conn, grace_s=SHUTDOWN_GRACE_S)
            raise message[1]
        return cls(process, conn, message[1], message[2])

    # requests ---------------------------------------------------------------------------------
    async def generate(self, prompt: str | Seq[int], params: SamplingParams | None, request_id: str,
                       media: Seq[ProcessedMedia] | None = None, *, export_from: int | None = None,
                       export_parts: bool = False, handoff: Handoff | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs (of params.output_kind: cumulative, deltas, or the final one) as tokens arrive, the
        last with finished=True. Raises ValueError before the first output if the request cannot
        run; leaving the iteration early aborts it. export_from, export_parts, handoff: prefill/decode
        disaggregation (LLMEngine.make_request)."""
        self._attach()
        if self._error is not None:
            raise self._error
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        # cumulative outputs are built on this side: only deltas cross the socket
        accumulator = OutputAccumulator() if params.output_kind is RequestOutputKind.CUMULATIVE else None
        if accumulator is not None:
            params = replace(params, output_kind=RequestOutputKind.DELTA)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        transfer = None
        if export_from is not None or handoff is not None:
            transfer = ("export", export_from, export_parts) if handoff is None else ("import", handoff)
        self._send(("add", request_id, prompt if isinstance(prompt, str) else list(prompt), params,
                    list(media) if media else None, time.monotonic(), transfer))
        combine = merge_deltas if params.output_kind is RequestOutputKind.DELTA else latest
        # closing this generator closes follow() at once, which aborts the request
        async with aclosing(follow(stream, lambda: self.abort(request_id), combine)) as outputs:
            async for out in outputs:
                if accumulator is not None:
                    accumulator.add(out)
                    out = accumulator.output()
                yield out

    async def held_prefix_tokens(self, prompt: str | Seq[int], media: Seq[ProcessedMedia] | None = None) -> int:
        """LLMEngine.held_prefix_tokens, asked of the engine process."""
        self._attach()
        if self._error is not None:
            raise self._error
        self._calls += 1
        reply = self._loop.create_future()
        self._replies[self._calls] = reply
        self._send(("held", self._calls, prompt if isinstance(prompt, str) else list(prompt),
                    list(media) if media else None))
        value = await reply
        if isinstance(value, BaseException):
            raise value
        return value

    def send_handoff_part(self, request_id: str, part: HandoffPart | None) -> None:
        """Send a handoff part ahead of the request it belongs to: the engine process keeps it and
        joins it with the handoff the request's generate(handoff=) brings (None: drop the parts sent
        for `request_id`, a prefill given up)."""
        if self._error is None:
            self._send(("part", request_id, part))

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason 'abort'."""
        if request_id in self._streams and self._error is None:
            self._send(("abort", request_id))

    def get_stats(self) -> EngineStats:
        """As of the engine's last step (or abort)."""
        return self._stats

    @property
    def alive(self) -> bool:
        return self._error is None and self.process.poll() is None

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the engine process (waiting up to SHUTDOWN_GRACE_S, then killing it); open streams
        fail with 'the engine was shut down'."""
        if self._error is None:
            self._error = EngineDeadError("the engine was shut down")
        self._outbox.put(("shutdown",))
        self._outbox.put(None)
        self._sender.join(timeout=SHUTDOWN_GRACE_S)
        _stop(self.process, self._conn, grace_s=SHUTDOWN_GRACE_S, send_shutdown=False)
        self._reader.join(timeout=SHUTDOWN_GRACE_S)
        self._dispatch(self._fail_all, self._error)

    # the socket -------------------------------------------------------------------------------
    def _attach(self) -> None:
        """Deliver outputs to the running loop (moving over from an earlier loop once its streams ended)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and self._loop.is_closed():
                self._streams.clear()  # aborted with their loop; their final outputs have no reader
            assert not self._streams, "an EngineClient's streams all run on one event loop"
            self._loop = loop

    def _send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                send(self._conn, message)
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _read_loop(self) -> None:
        while True:
            try:
                message = recv(self._conn)
            except (EOFError, OSError):
                try:  # here, not on the event loop: the process may take a moment to be reaped
                    code = self.process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    code = None
                self._dispatch(self._on_exit, code)
                return
            self._dispatch(self._on_message, message)

    def _dispatch(self, fn, *args) -> None:
        """Run fn on the streams' event loop (directly when there is none: then no stream is open)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
                return
            except RuntimeError:  # the loop closed in between
                pass
        fn(*args)

    def _on_message(self, message: tuple) -> None:
        if message[0] == "reply":
            reply = self._replies.pop(message[1], None)
            if reply is not None and not reply.done():
                reply.set_result(message[2])
            return
        kind, outputs, errors, stats = message
        assert kind == "step", f"unexpected message {kind!r}"
        self._stats = stats
        for request_id, error in errors:
            self._prompts.forget(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put_nowait(error)
        for out in outputs:
            out = self._prompts.restore(out)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)

    def _on_exit(self, code: int | None) -> None:
        """The socket closed under us: the engine process is gone (or close() stopped it)."""
        if self._error is None:
            self._error = EngineDeadError(f"the engine process (pid {self.process.pid}) exited with code {code}")
        self._fail_all(self._error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._streams.pop(request_id).put_nowait(error)
        for call_id in list(self._replies):
            reply = self._replies.pop(call_id)
            if not reply.done():
                reply.set_result(error)


def _wait_ready(conn: Connection, process: subprocess.Popen, timeout_s: float | None) -> tuple:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not conn.poll(1.0):
        if process.poll() is not None:
            raise RuntimeError(f"the engine process exited with code {process.returncode} while starting")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the engine process did not start within {timeout_s} s")
    try:
        return recv(conn)
    except EOFError:
        code = process.wait(timeout=SHUTDOWN_GRACE_S)
        raise RuntimeError(f"the engine process exited with code {code} while starting") from None


def _stop(process: subprocess.Popen, conn: Connection, grace_s: float, send_shutdown: bool = True) -> None:
    """Ask the process to stop (or expect it to, after a shutdown message), wait up to grace_s,
    then kill it; close the socket."""
    if process.poll() is None and not conn.closed and grace_s > 0:
        if send_shutdown:
            try:
                send(conn, ("shutdown",))
            except OSError:
                pass
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if process.poll() is None:
        process.kill()
        process.wait()
    if not conn.closed:
        conn.close()
