"""`k3ray cluster check`: join a running Ray cluster and read every alive node's k3ray settings
back (cluster/node_check.py); one line per node and variable missing or different, exit 1 if any. `k3ray
serve --address` prints the same lines as warnings before it deploys."""

from __future__ import annotations

import argparse
import sys

HELP = "read each node's settings back from a running cluster and name what is missing or different"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="the cluster's address (default: auto, the running one here)")


def main(args: argparse.Namespace) -> int:
    # lazy: Ray and pydantic stay out of `k3ray --help`
    import ray

    from k3ray.actors.cluster import node_check
    from k3ray.actors.cluster.ray_connect import connect

    connect(address=args.address, log_to_driver=False, logging_level="WARNING")
    try:
        nodes = node_check.alive_nodes()
        running, problems = node_check.check_nodes()
    finally:
        ray.shutdown()
    for line in problems:
        print(line)
    verdict = "settings missing or different" if problems else "every node has k3ray's settings"
    print(f"{len(nodes)} node(s), ingress {running}: {verdict}", file=sys.stderr)
    return 1 if problems else 0
