"""`k3ray bench <name>`: benchmarks that print a table and save JSON. Each is an entry point of
group `k3ray.benchmarks` (one home per layer: the model, kernels and engine here, the cluster and
serving in k3ray.actors.bench) exposing HELP, add_arguments(parser) and run(args) -> dict."""

from __future__ import annotations

import argparse

from k3ray.bench.common import print_table, write_json

HELP = "benchmarks that print and save JSON"
SUBCOMMANDS = "k3ray.benchmarks"


def add_leaf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="also write the result object to PATH (default: print only)")


def main(args: argparse.Namespace) -> int:
    result = args._leaf.run(args)
    print_table(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
