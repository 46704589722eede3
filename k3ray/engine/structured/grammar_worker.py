"""A grammar compiler's own process (started by grammar_compiler.GrammarWorker): compiles one
grammar at a time over the engine's vocabulary and sends it back serialized. Its parent enforces
the time and memory limits by killing it; it exits when the socket closes or its parent is gone.

    python -m k3ray.engine.structured.grammar_worker FD     # FD: this end of the parent's socketpair

Messages in:  (vocab, stop_token_ids) once, then ("compile", StructuredOutputsParams, max_bytes)
Messages out: ("ready",) once, then one answer per compile: ("compiled", CompiledGrammar.serialize_json())
              | ("too_large", compiled bytes) when it is over max_bytes | ("error", message)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing.connection import Connection

from k3ray.engine.pipe import recv, send
from k3ray.engine.structured.structured_output import StructuredOutputs

PARENT_CHECK_S = 1.0


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    _exit_with_parent(os.getppid())
    try:
        vocab, stop_token_ids = recv(conn)
    except (EOFError, OSError):
        return 1
    outputs = StructuredOutputs(vocab, stop_token_ids)
    send(conn, ("ready",))
    while True:
        try:
            kind, params, max_bytes = recv(conn)
        except (EOFError, OSError):
            return 0
        assert kind == "compile", f"unknown message {kind!r}"
        try:
            compiled = outputs.compile(params)
        except ValueError as e:
            send(conn, ("error", str(e)))
            continue
        size = compiled.memory_size_bytes
        send(conn, ("too_large", size) if size > max_bytes else ("compiled", compiled.serialize_json()))


def _exit_with_parent(parent: int) -> None:
    """The closed socket is only noticed between compiles, so an orphan would finish a long compile
    first: watch the parent too (xgrammar releases the GIL while it compiles)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
