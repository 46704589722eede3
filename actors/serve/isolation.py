"""What keeps two `k3ray serve` on one host apart: each local Ray instance's Serve gets its own
fallback-proxy ports, HAProxy stats and Prometheus ports, its own window of replica ports, and its
own runtime folder for HAProxy's config, admin socket and state files (Ray's defaults are fixed:
8500, 8404, 9101, 30000, /tmp/haproxy-serve, so a second server answered for the first, or failed
to start). A cluster node runs one Serve and keeps those defaults (cluster/node_environment.py holds what
every node needs). Folders left by a server that died are removed at start."""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import tempfile

RUNTIME_PREFIX = "k3serve-"  # short: see RUNTIME_ROOT
# Serve puts HAProxy's sockets two levels below (a 56-character hash folder): a Unix socket path
# holds at most 97 characters in HAProxy, so the folder sits in /tmp, never a long $TMPDIR
RUNTIME_ROOT = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
_RUNTIME_NAME = re.compile(rf"^{RUNTIME_PREFIX}(\d+)-")
REPLICA_PORT_WINDOW = 1000  # ports per server for its replicas' HTTP (and gRPC) servers
# above Ray's worker ports (10002-19999), below Linux's ephemeral ones (32768-60999)
PORT_RANGE = (20000, 32768 - REPLICA_PORT_WINDOW)
PORT_TRIES = 200


def free_port(ports: tuple[int, int] = PORT_RANGE) -> int:
    """A TCP port nothing listens on now, on loopback, drawn from ports [low, high). Not bind(0): the
    kernel hands out ephemeral ports to outgoing connections too, so one can be taken before its
    server binds it (seen: HAProxy's stats port, 'Address already in use' on all three starts)."""
    for _ in range(PORT_TRIES):
        port = random.randrange(*ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in [{ports[0]}, {ports[1]}) after {PORT_TRIES} tries")


def isolation_environment(runtime_dir: str) -> dict[str, str]:
    """The environment that gives one local Serve instance its own ports and HAProxy files (the
    HAProxy stats and Prometheus ports as the environment sets them, else free ones)."""
    env = {name: os.environ.get(name) or str(free_port())
           for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")}
    env |= {"RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(runtime_dir, "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(runtime_dir, "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": runtime_dir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(runtime_dir, "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(runtime_dir, "metrics.sock")}
    # a port free now starts the window (PORT_RANGE ends a window below the ephemeral ports); Serve retries a taken one
    for protocol in ("HTTP", "GRPC"):
        low = free_port()
        env[f"RAY_SERVE_DIRECT_INGRESS_MIN_{protocol}_PORT"] = str(low)
        env[f"RAY_SERVE_DIRECT_INGRESS_MAX_{protocol}_PORT"] = str(low + REPLICA_PORT_WINDOW)
    return env


def make_runtime_dir() -> str:
    """A private folder (mode 700) named after this process, after removing those of dead ones."""
    remove_stale_runtime_dirs()
    return tempfile.mkdtemp(prefix=f"{RUNTIME_PREFIX}{os.getpid()}-", dir=RUNTIME_ROOT)


def remove_runtime_dir(path: str | None) -> None:
    if path and os.path.basename(path).startswith(RUNTIME_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_runtime_dirs(root: str | None = None) -> list[str]:
    """Remove the runtime folders (of this user) whose process is gone; returns their paths."""
    root = root or RUNTIME_ROOT
    removed = []
    for name in os.listdir(root):
        match = _RUNTIME_NAME.match(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isdir(path) or os.stat(path).st_uid != os.getuid():
            continue
        if not alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def alive(pid: int) -> bool:
    """Whether process `pid` runs (as any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
