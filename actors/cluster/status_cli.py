"""`k3ray status`: where every k3ray replica's actors run, one line each: the Serve replica, its
pipeline stages, MoE routers, expert shards and vision encoder, with node, device and Ray's state
of the actor (cluster/placement_table.py; from Ray's GCS, without the dashboard and without joining).

    k3ray status                      # the cluster running on this machine (or $RAY_ADDRESS)
    k3ray status --address HEAD:6379 --json placement.json
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "list each k3ray replica's actors (stages, routers, shards, vision) with node, device and state"
COLUMNS = ("app", "replica", "actor", "node", "device", "state")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="the Ray cluster's GCS address (default: auto, the running one)")
    p.add_argument("--app", default=None, help="only this Serve app's replicas (default: every app's K3Server)")
    p.add_argument("--json", metavar="PATH", help="also write the rows to PATH as JSON (default: no file)")


def main(args: argparse.Namespace) -> int:
    # lazy: Ray's GCS client stays out of `k3ray --help`
    from k3ray.actors.cluster.placement_table import gcs_state, placement_rows

    try:
        state = gcs_state(args.address)
    except ConnectionError as e:
        raise ValueError(f"no Ray cluster at {args.address}: {e}") from None
    rows = placement_rows(state, args.app)
    print(table(rows), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row.as_dict() for row in rows], f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    if not rows:
        print("no k3ray replica is running", file=sys.stderr)
    return 0


def table(rows) -> str:
    """The rows as aligned text columns (a node shown as `address (id prefix)`, `, dead` when lost)."""
    cells = [tuple(c.upper() for c in COLUMNS)] + [(r.app, r.replica, r.actor,
                          f"{r.node_address} ({r.node_id[:8]}{'' if r.node_alive else ', dead'})",
                          r.device, r.state + (f" (restarts {r.restarts})" if r.restarts else "")) for r in rows]
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(COLUMNS))]
    return "".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() + "\n" for row in cells)
