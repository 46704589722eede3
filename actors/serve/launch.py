"""Start Ray and Serve, deploy the app, stop them again: what `k3ray serve` and the tests share.

    url = deploy({"engine": {"max_num_seqs": 8}}, host="127.0.0.1", port=8000)   # after start_ray()
    ...
    stop()
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import ray
from ray import serve
from ray._private import ray_constants, services
from ray.serve._private import build_app as serve_build_app
from ray.serve._private import constants as serve_constants
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.context import _disconnect, _get_global_client

from k3ray.actors.cluster.node_environment import node_environment
from k3ray.actors.cluster.ray_connect import connect  # ray.init off the repository root
from k3ray.actors.serve.app import build_app
from k3ray.actors.serve.config import APP_NAME, DEFAULT_INGRESS, LOOPBACK
from k3ray.actors.serve.isolation import isolation_environment, make_runtime_dir, remove_runtime_dir

START_ATTEMPTS = 3


def start_ray(address: str | None = None, ingress: str = DEFAULT_INGRESS, **init_kwargs) -> bool:
    """Join `address`, or start a private local instance bound to loopback whose Serve uses
    `ingress`; True if this call started Ray (so the caller should shut it down), False after
    joining a cluster (the caller deletes only its own app). A joined cluster keeps the ingress
    its nodes were started with (cluster/ sets haproxy)."""
    if ray.is_initialized():
        return False
    if address is not None:
        connect(address=address, **init_kwargs)
        return False
    prepare_local(ingress)
    try:
        with own_process_groups():
            _start_local({"include_dashboard": False, "_node_ip_address": LOOPBACK, **init_kwargs})
    except BaseException:
        remove_runtime_dir(os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE"))
        restore_environment()
        raise
    return True


@contextlib.contextmanager
def own_process_groups() -> Iterator[None]:
    """Ray's processes started in the block (GCS, raylet, agents; the raylet's workers lead groups
    of their own already) each lead a process group: a signal to this process's group (`kill --
    -PGID`, a terminal's Ctrl-C) reaches this process alone, which stops them in order. In this
    process's group, SIGTERM killed GCS and the raylet first and left the workers running 60 s."""
    original = services.ConsolePopen

    class OwnGroupPopen(original):
        def __init__(self, *args, **kwargs) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = original


# what prepare_local replaced, for restore_environment: variable -> old value (None: unset), and
# (module, attribute) -> old value; a process that stops its Ray leaves no setting behind (tests share one)
_saved_variables: dict[str, str | None] = {}
_saved_attributes: dict[tuple[object, str], object] = {}


def prepare_local(ingress: str) -> None:
    """The environment and Serve / Ray settings a local instance for `ingress` starts with."""
    env = local_environment(ingress)  # Ray's processes inherit it from here
    # node address 127.0.0.1: every connection stays on loopback, Ray's agents and exporters bind to it (not 0.0.0.0)
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"))
    for name, value in env.items():
        _saved_variables.setdefault(name, os.environ.get(name))
        os.environ[name] = value
    # Ray read that variable when it was imported (before this call, in `k3ray serve`): without
    # this its node address was the machine's and its agents listened on every interface
    cluster_mode = env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False")
    use_ingress(ingress)
    _set_attribute(ray_constants, "ENABLE_RAY_CLUSTER", cluster_mode)


def use_ingress(ingress: str) -> None:
    """This process's Serve (the app's build, its check of the ingress request router) as for
    `ingress`: a joined cluster's Serve runs the ingress its head started with, whatever this
    process's environment says (restore_environment puts it back)."""
    for module in (serve_constants, serve_build_app):
        _set_attribute(module, "RAY_SERVE_ENABLE_HA_PROXY", ingress == "haproxy")


def _set_attribute(module: object, name: str, value: object) -> None:
    _saved_attributes.setdefault((module, name), getattr(module, name))
    setattr(module, name, value)


def restore_environment() -> None:
    """Put back what prepare_local and use_ingress changed (stop() does, after Ray is down)."""
    for name, value in _saved_variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for (module, name), value in _saved_attributes.items():
        setattr(module, name, value)
    _saved_variables.clear()
    _saved_attributes.clear()


def local_environment(ingress: str) -> dict[str, str]:
    """What the processes of a Ray instance started here for Serve inherit: what every node of a
    cluster needs for `ingress` (cluster/node_environment.py), and this instance's own ports and HAProxy
    files (a new runtime folder), so several servers share one machine."""
    return {**node_environment(ingress), **isolation_environment(make_runtime_dir())}


def _start_local(init_kwargs: dict) -> None:
    """ray.init of a local instance, tried again after a transient failure (on a busy machine the
    raylet missed Ray's fixed 30 s to register)."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            connect(address="local", **init_kwargs)
            return
        except Exception as e:  # noqa: BLE001 - ray.init raises a plain Exception for its start timeouts
            ray.shutdown()
            transient = isinstance(e, (TimeoutError, ConnectionError)) or "timed out" in str(e)
            if not transient or attempt == START_ATTEMPTS:
                raise ValueError(f"Ray did not start ({attempt} attempt(s)): {type(e).__name__}: {e}; on a busy "
                                 "machine retry when it is quieter or give fewer --num-cpus") from e


def deploy(args: dict, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME,
           route_prefix: str = "/", proxy_location: str = "EveryNode") -> str:
    """Start Serve's HTTP proxies on host:port (if not running) and deploy the app (args: ServeArgs'
    nested groups); returns its URL once every replica is up (raises if the app fails to deploy).
    Nodes sharing one machine (a test cluster) need proxy_location="HeadOnly"."""
    serve.start(http_options={"host": host, "port": port}, proxy_location=proxy_location)
    serve.run(build_app(args), name=name, route_prefix=route_prefix, blocking=False)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{route_prefix.rstrip('/')}"


def stop(owns_ray: bool = True, name: str = APP_NAME) -> None:
    """On a Ray instance this process started: delete the app `name` if it runs (its replicas
    finish their requests in flight behind the proxy, which keeps running meanwhile), then shut
    Serve (whatever still starts, the proxy) and Ray down. On a joined cluster: delete only this
    app, then disconnect."""
    if not ray.is_initialized():
        return
    if not owns_ray or app_status(name) == "RUNNING":  # an app still deploying has nothing in flight
        delete_app(name)
    if owns_ray:
        shutdown_serve()
    ray.shutdown()
    if owns_ray:
        remove_runtime_dir(os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE"))
    restore_environment()


def app_status(name: str = APP_NAME) -> str | None:
    """The status of the app `name` (RUNNING, DEPLOYING, ...), None without Serve or the app."""
    if _get_global_client(raise_if_no_controller_running=False) is None:
        return None
    app = serve.status().applications.get(name)
    return None if app is None else app.status.value


def delete_app(name: str = APP_NAME) -> None:
    """Delete the app `name`, waiting while its replicas drain (a Serve shutdown stopped HAProxy
    first and cut the streams in flight) and then go with their placement groups; Serve and every
    other app keep running. Nothing to do without Serve or the app."""
    if app_status(name) is not None:
        serve.delete(name)


def shutdown_serve(timeout_s: float = 60.0) -> None:
    """serve.shutdown() without its never-answered call: Serve waits on a controller task that ends
    only when the controller kills itself, so Ray logged `graceful_shutdown failed ... killed by
    ray.kill` on every clean stop. The controller is asked to shut down without that wait, and this
    waits for it (replicas, proxies, then itself) to be gone."""
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    ray.get(client._controller.graceful_shutdown.remote(wait=False))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # the controller is gone: everything it ran is stopped
            break
        time.sleep(0.2)
    _disconnect()
