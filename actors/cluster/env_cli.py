"""`k3ray cluster env`: the environment every Ray node needs for k3ray's Serve app, printed for
`ray start` on a node started by hand (the image in cluster/ sets the same; cluster/node_environment.py
defines it once). `k3ray serve` sets these for the Ray instance it starts itself.

    eval "$(k3ray cluster env)" && ray start --head --port 6379      # the head
    eval "$(k3ray cluster env)" && ray start --address HEAD:6379     # each worker
    k3ray cluster env --format env > k3ray.env                       # docker --env-file, systemd

The k3ray-haproxy path is this machine's: run it on each node (or where the path is the same).
"""

from __future__ import annotations

import argparse
import json
import shlex

from k3ray.actors.serve.config import DEFAULT_INGRESS

HELP = "print the environment every node's `ray start` needs (shell exports, NAME=value lines or JSON)"
FORMATS = ("shell", "env", "json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # lazy: pydantic (the settings) stays out of `k3ray --help`
    from k3ray.actors.cluster.node_environment import INGRESS_MODES

    p.add_argument("--ingress", choices=INGRESS_MODES, default=DEFAULT_INGRESS,
                   help=f"the ingress the nodes' Serve runs (default: {DEFAULT_INGRESS}, as k3ray serve's)")
    p.add_argument("--format", choices=FORMATS, default="shell",
                   help="shell: `export NAME=value` lines with a comment each (for eval); env: NAME=value lines; "
                        "json: one object (default: shell)")


def main(args: argparse.Namespace) -> int:
    print(render(args.ingress, args.format), end="")
    return 0


def render(ingress: str, form: str) -> str:
    # lazy: pydantic (the settings) stays out of `k3ray --help`
    from k3ray.actors.cluster.node_environment import node_environment, node_variables

    env = node_environment(ingress)
    if form == "json":
        return json.dumps(env, indent=2) + "\n"
    if form == "env":
        return "".join(f"{name}={value}\n" for name, value in env.items())
    lines = [f"# k3ray node settings (ingress {ingress}): in the environment of `ray start` on every node"]
    for var in node_variables(ingress):
        where = "; read by the head's GCS" if var.head_only else ""
        lines += [f"# {var.why} (without it: {var.serve_default}{where})",
                  f"export {var.name}={shlex.quote(env[var.name])}"]
    return "\n".join(lines) + "\n"
