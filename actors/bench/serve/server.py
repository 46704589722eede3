"""k3ray's Serve app on 127.0.0.1 for the length of a benchmark, and the routes it is probed by."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import httpx


def wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.5)


@contextlib.contextmanager
def local_serve_app(serve_args: dict, port: int | None = None, ingress: str = "haproxy") -> Iterator[str]:
    """Start a private Ray instance and Serve (with `ingress` in front) on loopback, deploy the app,
    yield its URL; then stop Serve and Ray again."""
    # lazy: Ray and the Serve app only for a local server: --endpoint runs go without them
    import ray

    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve.isolation import free_port

    if ray.is_initialized():
        raise ValueError("this process is already connected to Ray: benchmark its server with --endpoint URL, "
                         "or run `k3ray bench serve` in a fresh process to start a private one")
    started = serve_launch.start_ray(ingress=ingress, num_cpus=max(4, os.cpu_count() or 1), log_to_driver=False)
    try:
        url = serve_launch.deploy(serve_args, host="127.0.0.1", port=port or free_port(),
                                  proxy_location="HeadOnly")
        wait_healthy(url)
        yield url
    finally:
        serve_launch.stop(owns_ray=started)


def server_facts(url: str, model: str | None, timeout: float = 30.0, api_key: str | None = None) -> tuple[str, dict]:
    """(the served model name, /tokenizer_info or {})."""
    with httpx.Client(base_url=url, timeout=timeout, headers=auth_headers(api_key)) as client:
        if model is None:
            cards = client.get("/v1/models").json().get("data") or []
            if not cards:
                raise ValueError(f"{url}/v1/models lists no model; pass --served-model-name")
            model = cards[0]["id"]
        response = client.get("/tokenizer_info")
        info = response.json() if response.status_code == 200 else {}
    return model, info


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
