"""The Serve config YAML of `k3ray serve` flags (`k3ray serve ... --print-config`): the same app for
`serve run` / `serve deploy` / a RayService, every setting written with its default and its
description as a comment, so the file documents itself and is regenerated, never edited."""

from __future__ import annotations

import textwrap

from pydantic import BaseModel

from k3ray.actors.serve.config import APP_NAME, IMPORT_PATH, LOOPBACK, LaunchSettings, ServeArgs
from k3ray.actors.serve.flags import scalar

WIDTH = 110
HEADER = """\
Ray Serve config of k3ray's OpenAI-compatible app (the app `k3ray serve` deploys), written by
{command}
Change those flags and rerun it rather than editing this text (a test compares the two).
  serve run FILE        # local: starts Ray, blocks until Ctrl-C
  serve deploy FILE     # a running cluster (`ray start --head` first)
Every node's Ray needs k3ray's node settings in its environment when it starts (the image sets them):
  eval "$(k3ray cluster env)" && serve run FILE
`args` are k3ray.actors.serve.config.ServeArgs in groups: an unknown key is rejected, a key left out
takes its default. Set K3RAY_API_KEY in the cluster's environment (or server.api_key) to require
`Authorization: Bearer <key>`."""


def serve_config_yaml(args: ServeArgs, launch: LaunchSettings, flags: list[str]) -> str:
    """The Serve config of `args` served at launch's host:port; `flags` (`--flag value` each) are
    the command's flags that give them, named in the header."""
    lines = [f"# {line}" for line in HEADER.format(command=_command(flags)).splitlines()]
    launch = launch.on_nodes([LOOPBACK])  # a host and proxies not given are written as for one machine
    lines += _fields(launch, "", only=("proxy_location",))
    lines += ["http_options:", *_fields(launch, "  ", only=("host", "port"))]
    lines += ["applications:", f"  - name: {APP_NAME}", "    route_prefix: /", f"    import_path: {IMPORT_PATH}",
              "    args:"]
    for group in ServeArgs.model_fields:
        settings: BaseModel = getattr(args, group)
        lines += _comment(settings.__doc__, "      ")
        lines += [f"      {group}:", *_fields(settings, "        ")]
    return "\n".join(lines) + "\n"


def _command(flags: list[str]) -> str:
    """`  k3ray serve FLAGS --print-config`, continued with backslashes over lines of at most WIDTH."""
    lines = ["  k3ray serve"]
    for word in [*flags, "--print-config"]:
        if len(lines[-1]) + len(word) + 5 > WIDTH:
            lines[-1] += " \\"
            lines.append("   ")
        lines[-1] += f" {word}"
    return "\n".join(lines)


def _fields(settings: BaseModel, indent: str, only: tuple[str, ...] | None = None) -> list[str]:
    lines = []
    for name, info in type(settings).model_fields.items():
        if only is None or name in only:
            lines += _comment(info.description, indent)
            lines.append(f"{indent}{name}: {scalar(getattr(settings, name))}")
    return lines


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), WIDTH, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
                         break_on_hyphens=False)
