"""Messages between k3ray's own processes (the engine process, grammar workers) over one end of a
socketpair: whole Python objects, one pickle each."""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection


def send(conn: Connection, message) -> None:
    """Plain pickle: multiprocessing's pickler would pass tensors as shared-memory handles that
    only a multiprocessing-spawned peer can open."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection):
    return pickle.loads(conn.recv_bytes())
