"""Calls to a deployment's methods from a driver (a test, a benchmark), their handle shut down after:
a handle left open keeps pushing its metrics to Serve's controller from a background thread, which
brings Ray up again in a driver that has disconnected since (its next `ray.init` then fails)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ray import serve
from ray.serve.handle import DeploymentHandle


@contextmanager
def deployment_handle(app: str, deployment: str) -> Iterator[DeploymentHandle]:
    """A handle to `deployment` of `app`, shut down when the block ends (with every handle for a
    method made from it in the block: they share its router once it has made one)."""
    handle = serve.get_deployment_handle(deployment, app)
    try:
        yield handle
    finally:
        handle.shutdown()


def call_deployment(app: str, deployment: str, method: str, *args, timeout_s: float = 60.0, **kwargs):
    """One call of `method` on a replica of `deployment` (Serve picks it) -> its result."""
    with deployment_handle(app, deployment) as handle:
        method_handle = getattr(handle, method)
        try:
            return method_handle.remote(*args, **kwargs).result(timeout_s=timeout_s)
        finally:
            method_handle.shutdown()
