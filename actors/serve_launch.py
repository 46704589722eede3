"""Start Ray and Serve, deploy the app, stop them again: what `k3ray serve` and the tests share.

    url = deploy(args, host="127.0.0.1", port=8000)   # after start_ray()
    ...
    stop()
"""

from __future__ import annotations

import os

import ray
from ray import serve

from k3ray.actors.serve_app import build_app

APP_NAME = "k3ray"


def start_ray(address: str | None = None, **init_kwargs) -> bool:
    """Join `address`, or start a private local instance bound to loopback; True if this call
    started Ray (so the caller should shut it down)."""
    if ray.is_initialized():
        return False
    if address is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray listener on 127.0.0.1
        ray.init(address="local", **{"include_dashboard": False, **init_kwargs})
    else:
        ray.init(address=address, **init_kwargs)
    return True


def deploy(args: dict, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME,
           route_prefix: str = "/", proxy_location: str = "EveryNode") -> str:
    """Start Serve's HTTP proxies on host:port (if not running) and deploy the app; returns its URL
    once every replica is up (raises if the app fails to deploy). Nodes sharing one machine (a
    test cluster) need proxy_location="HeadOnly"."""
    serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    serve.run(build_app(args), name=name, route_prefix=route_prefix, blocking=False)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{route_prefix.rstrip('/')}"


def stop(owns_ray: bool = True, name: str = APP_NAME) -> None:
    """On a Ray instance this process started: shut Serve (replicas, their placement groups, the
    proxy) and Ray down. On a joined cluster: delete only this app, then disconnect."""
    if not ray.is_initialized():
        return
    if owns_ray:
        serve.shutdown()
    else:
        serve.delete(name)
    ray.shutdown()
