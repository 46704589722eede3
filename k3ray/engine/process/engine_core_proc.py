"""The engine's own process (started by EngineClient): build the engine, then loop — apply the
requests and aborts that arrived, run one step, send its outputs as deltas with the engine's
stats. It blocks on the socket while idle and exits when the socket closes (its parent is gone)
or a shutdown message arrives; a watcher thread ends it within a second of its parent's death
even while it builds the engine or runs a long step (it never reads the socket then).

    python -m k3ray.engine.process.engine_core_proc FD PID   # FD: this end of the parent's socketpair, PID: the parent

Messages in:  ("add", request_id, prompt, params, media, arrival_time, transfer) | ("abort", request_id)
              | ("held", call_id, prompt, media) | ("part", request_id, HandoffPart | None) | ("shutdown",);
              the first message is the engine factory (a picklable callable). transfer: None,
              ("export", first token to hand off, parts too) or ("import", Handoff) — prefill/decode
              disaggregation (LLMEngine.make_request). A "part" is kept until the request's import
              "add" joins it with the handoff (None: drop the request's parts, a prefill given up).
Messages out: ("ready", EngineInfo, EngineStats) | ("failed", error) once, then
              ("step", [RequestOutput], [(request_id, error)], EngineStats) whenever something
              happened, and at least every STATS_EVERY_S while steps run. The outputs are what the
              requests' output_kind asks for (EngineClient asks deltas); a request's prompt and its
              ids travel in its first output only (WirePrompts). ("reply", call_id, value or error)
              answers a "held" (LLMEngine.held_prefix_tokens) at once.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection

from k3ray.engine.outputs import RequestOutput
from k3ray.engine.process.engine_info import EngineInfo
from k3ray.engine.pipe import recv, send
from k3ray.engine.step_or_abort import step_or_abort

# steps without outputs (a long prefill) still report the stats this often, for admission and metrics
STATS_EVERY_S = 0.25


def portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")


class WirePrompts:
    """A request's prompt crosses the socket once: `strip` (engine side) drops it from every output
    but the first, `restore` (client side) puts it back. One instance per side."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[str | None, list[int] | None]] = {}

    def strip(self, out: RequestOutput) -> RequestOutput:
        first = out.request_id not in self._prompts
        if out.finished:
            self._prompts.pop(out.request_id, None)
        elif first:
            self._prompts[out.request_id] = (None, None)  # sent: the engine holds the prompt itself
        return out if first else replace(out, prompt=None, prompt_token_ids=None)

    def restore(self, out: RequestOutput) -> RequestOutput:
        if out.prompt_token_ids is None:
            prompt, ids = self._prompts[out.request_id]
            out = replace(out, prompt=prompt, prompt_token_ids=ids)
        elif not out.finished:
            self._prompts[out.request_id] = (out.prompt, out.prompt_token_ids)
        if out.finished:
            self._prompts.pop(out.request_id, None)
        return out

    def forget(self, request_id: str) -> None:
        """The request ended without a finished output (it failed)."""
        self._prompts.pop(request_id, None)


def serve_engine(engine, conn: Connection) -> None:
    """Run until the parent sends ("shutdown",) or closes the socket."""
    prompts = WirePrompts()
    parts: dict[str, list] = {}  # handoff parts of imports still to come, by request id
    last_sent = time.monotonic()
    while True:
        outputs, errors = [], []
        try:
            # block while idle with nothing to report; otherwise only take what has already arrived
            while conn.poll(0 if engine.has_unfinished_requests() or outputs or errors else None):
                message = recv(conn)
                if message[0] == "add":
                    request_id, prompt, params, media, arrival_time, transfer = message[1:]
                    kw = {}
                    if transfer is not None and transfer[0] == "export":
                        kw["export_from"], kw["export_parts"] = transfer[1], transfer[2]
                    try:
                        if transfer is not None and transfer[0] == "import":
                            kw["handoff"] = transfer[1].joined(parts.pop(request_id, []))
                        engine.add_request(request_id, prompt, params, arrival_time, media, **kw)
                    except Exception as e:  # noqa: BLE001 - this request fails (ValueError: a bad one), the rest go on
                        errors.append((request_id, portable(e)))
                elif message[0] == "held":
                    call_id, prompt, media = message[1:]
                    try:
                        value = engine.held_prefix_tokens(prompt, media)
                    except Exception as e:  # noqa: BLE001 - the caller gets the error
                        value = portable(e)
                    send(conn, ("reply", call_id, value))
                elif message[0] == "part":
                    request_id, part = message[1:]
                    if part is None:
                        parts.pop(request_id, None)
                    else:
                        parts.setdefault(request_id, []).append(part)
                elif message[0] == "abort":
                    parts.pop(message[1], None)
                    final = engine.abort_request(message[1])
                    if final is not None:
                        outputs.append(final)
                else:
                    assert message[0] == "shutdown", f"unknown message {message[0]!r}"
                    return
        except (EOFError, OSError):
            return
        if engine.has_unfinished_requests():
            step = step_or_abort(engine)
            outputs.extend(step.outputs)
            if step.aborted:  # the step failed: every request it took down fails with the cause
                error = portable(step.error)
                for request_id in step.aborted:
                    prompts.forget(request_id)
                    errors.append((request_id, error))
            errors.extend((request_id, portable(e)) for request_id, e in engine.take_failed())
        if outputs or errors or time.monotonic() - last_sent >= STATS_EVERY_S:
            try:
                send(conn, ("step", [prompts.strip(o) for o in outputs], errors, engine.get_stats()))
            except (EOFError, OSError):
                return
            last_sent = time.monotonic()


PARENT_POLL_S = 0.5


def exit_with_parent(parent: int) -> None:
    """On a daemon thread: os._exit(1) once this process's parent is no longer `parent`."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def main(argv: list[str]) -> int:
    # the parent's pid comes from the parent: it may have died while this process imported torch
    parent = int(argv[1]) if len(argv) > 1 else os.getppid()
    threading.Thread(target=exit_with_parent, args=(parent,), name="exit-with-parent", daemon=True).start()
    conn = Connection(int(argv[0]))
    try:
        factory = recv(conn)
        engine = factory()
    except (EOFError, OSError):
        return 1
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        send(conn, ("failed", portable(e)))
        return 1
    send(conn, ("ready", EngineInfo.of(engine), engine.get_stats()))
    try:
        serve_engine(engine, conn)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
