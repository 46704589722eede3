"""`k3ray` console entry point. Each subcommand lives in its own module, imported on use."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_arguments(parser) and main(args) -> int
COMMANDS = {
    "info": ("k3ray.commands.info", "parameter counts and per-sequence memory of a preset or checkpoint"),
    "generate": ("k3ray.commands.generate", "generate text in this process from a checkpoint"),
    "serve": ("k3ray.commands.serve", "serve a checkpoint with an OpenAI-compatible API on Ray Serve"),
    "plan": ("k3ray.commands.plan", "size a deployment: actor layout, devices and memory per actor"),
    "bench": ("k3ray.bench.cli", "benchmarks that print and save JSON"),
    "eval": ("k3ray.commands.eval", "long-context and multimodal evals against an endpoint or engine"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Only the selected subcommand's module is imported (the others may pull in heavy packages)."""
    parser = argparse.ArgumentParser(prog="k3ray", description="Serve and evaluate Kimi K3 on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == selected:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(selected if selected in COMMANDS else None).parse_args(argv)
    try:
        return importlib.import_module(args._module).main(args) or 0
    except ValueError as e:
        print(f"k3ray {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
