"""The node settings of a joined Ray cluster, read back from every node and held against
cluster/node_environment.py. Ray exposes no node's environment, so a task pinned to each alive node
(NodeAffinitySchedulingStrategy, no CPU) reads the variables from its worker's environment, which
the node's raylet hands on from `ray start`'s. `k3ray serve --address` prints one warning line per
node and variable missing or different; `k3ray cluster check` prints them and exits 1.

    problems = check_nodes()      # after ray.init(address=...)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from k3ray.actors.cluster.node_environment import HAPROXY_BINARY, WRAPPER_NAME, node_environment, node_variables

HEAD_RESOURCE = "node:__internal_head__"
READ_TIMEOUT_S = 60.0  # a node starts a worker process for the task (seconds on a busy machine)
NAMES = sorted({v.name for ingress in ("haproxy", "proxy") for v in node_variables(ingress)})


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    is_head: bool

    def __str__(self) -> str:
        return f"node {self.address} ({'head' if self.is_head else 'worker'} {self.node_id[:8]})"


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes, the head first."""
    nodes = [Node(n["NodeID"], n["NodeManagerAddress"], HEAD_RESOURCE in n.get("Resources", {}))
             for n in ray.nodes() if n["Alive"]]
    return sorted(nodes, key=lambda n: not n.is_head)


def _read_environment(names: list[str]) -> dict[str, str | None]:
    """On the node: the variables' values (None: unset), and whether HAPROXY_BINARY names an executable."""
    found: dict[str, str | None] = {name: os.environ.get(name) for name in names}
    binary = found.get(HAPROXY_BINARY)
    found["executable"] = "1" if binary and os.path.isfile(binary) and os.access(binary, os.X_OK) else None
    return found


def read_nodes(nodes: list[Node], timeout_s: float = READ_TIMEOUT_S) -> dict[Node, dict[str, str | None] | None]:
    """Each node's variables (NAMES), None for a node that did not answer within timeout_s."""
    read = ray.remote(num_cpus=0, max_retries=0)(_read_environment)
    refs = {node: read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)).remote(
        NAMES) for node in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict[Node, dict[str, str | None] | None] = {}
    for node, ref in refs.items():
        try:
            out[node] = ray.get(ref) if ref in ready else None
        except ray.exceptions.RayError:  # the node died meanwhile
            out[node] = None
        if ref not in ready:
            ray.cancel(ref, force=True)
    return out


def head_ingress(found: dict[Node, dict[str, str | None] | None]) -> tuple[str, str]:
    """(the ingress the cluster's Serve runs, the one its nodes are meant for): Serve's controller
    runs on the head and reads RAY_SERVE_ENABLE_HA_PROXY there; unset, Serve runs its proxy actor,
    but the nodes are held to k3ray's default (haproxy) unless the head sets it to 0."""
    head = next((env for node, env in found.items() if node.is_head and env is not None), None)
    value = None if head is None else head.get("RAY_SERVE_ENABLE_HA_PROXY")
    return ("haproxy" if value == "1" else "proxy"), ("proxy" if value == "0" else "haproxy")


def problems(found: dict[Node, dict[str, str | None] | None], ingress: str) -> list[str]:
    """One line per node and variable that is missing or differs from node_environment(ingress)
    (as this process's environment gives it), and per node that did not answer."""
    expected = node_environment(ingress)
    lines = []
    for node, env in found.items():
        if env is None:
            lines.append(f"{node}: not checked (its task did not run within {READ_TIMEOUT_S:g} s)")
            continue
        for var in node_variables(ingress):
            if var.head_only and not node.is_head:
                continue
            value, want = env.get(var.name), expected[var.name]
            if var.name == HAPROXY_BINARY:
                if value is None or os.path.basename(value) != WRAPPER_NAME or not env["executable"]:
                    lines.append(f"{node}: {var.name}={value or '(unset)'} is not an executable {WRAPPER_NAME} "
                                 f"(without it: {var.serve_default}); {var.why}")
            elif value is None:
                lines.append(f"{node}: {var.name} is not set (without it: {var.serve_default}); k3ray's is "
                             f"{want}: {var.why}")
            elif value != want:
                lines.append(f"{node}: {var.name}={value}, k3ray's is {want}: {var.why}")
    return lines


def check_nodes(timeout_s: float = READ_TIMEOUT_S) -> tuple[str, list[str]]:
    """(the ingress the cluster's Serve runs, the problems of its nodes' settings) for the cluster
    this process is connected to."""
    found = read_nodes(alive_nodes(), timeout_s)
    running, meant = head_ingress(found)
    return running, problems(found, meant)
