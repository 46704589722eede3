"""`k3ray cluster <command>`: what an operator of a Ray cluster runs beside `k3ray serve --address`.

    k3ray cluster env                  # the environment every node's `ray start` needs, as shell exports
    k3ray cluster check --address auto # each node's settings read back: one line per one missing or different

Each subcommand is an entry point of group `k3ray.cluster` exposing HELP, add_arguments(parser)
and main(args) -> int.
"""

from __future__ import annotations

import argparse

HELP = "node settings of a Ray cluster for k3ray: print them (env), check a running cluster's (check)"
SUBCOMMANDS = "k3ray.cluster"


def main(args: argparse.Namespace) -> int:
    return args._leaf.main(args)
