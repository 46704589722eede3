"""`k3ray` console entry point. Subcommands are found through entry points, so the core names no
module above it: `k3ray.commands` (serve lives in k3ray.actors, eval in k3ray.evals) and, for
`k3ray bench`, `k3ray.benchmarks` (each benchmark beside what it measures).

A command module exposes HELP, add_arguments(parser) and main(args) -> int. One with SUBCOMMANDS
(an entry-point group) gets that group's modules as its subcommands: each exposes HELP and
add_arguments, the parent's add_leaf_arguments(parser) adds flags common to all of them, and the
parent's main finds the chosen one in args._leaf. Only the modules on the way to the selected
command are imported (the others may pull in torch)."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from types import ModuleType

from k3ray.cli_flags import show_defaults
from k3ray.model_names import check_model_argument

COMMANDS_GROUP = "k3ray.commands"


def registry(group: str) -> dict[str, EntryPoint]:
    """name -> entry point of one group, from the installed distributions' metadata."""
    return {ep.name: ep for ep in sorted(entry_points(group=group), key=lambda ep: ep.name)}


def add_subcommands(parser: argparse.ArgumentParser, group: str, argv: list[str], depth: int = 0,
                    parent: ModuleType | None = None) -> None:
    """One subparser per entry point of `group`; argv's positionals pick which get their flags."""
    commands = registry(group)
    if not commands:
        raise RuntimeError(f"no entry points in group {group!r}: is k3ray installed (pip install -e .)?")
    positionals = [a for a in argv if not a.startswith("-")]
    selected = positionals[depth] if len(positionals) > depth else None
    sub = parser.add_subparsers(dest="command" if depth == 0 else f"command_{depth}", metavar="COMMAND", required=True)
    for name, ep in commands.items():
        module = ep.load() if selected in (None, name) or selected not in commands else None
        help_text = module.HELP if module else None
        p = sub.add_parser(name, help=help_text, description=module.__doc__ if module else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name != selected:
            continue
        p.set_defaults(**({"_leaf": module} if parent else {"_module": module}))
        if getattr(module, "SUBCOMMANDS", None):
            add_subcommands(p, module.SUBCOMMANDS, argv, depth + 1, parent=module)
            continue
        if parent is not None and hasattr(parent, "add_leaf_arguments"):
            parent.add_leaf_arguments(p)
        module.add_arguments(p)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3ray", description="Serve and evaluate Kimi K3 on Ray.")
    parser.add_argument("--version", action="version", version=f"k3ray {_installed_version()}")
    add_subcommands(parser, COMMANDS_GROUP, argv)
    show_defaults(parser)
    return parser


def _installed_version() -> str:
    try:
        return version("k3ray")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    module: ModuleType = args._module
    try:
        check_model_argument(args)  # a mistyped --model ends here, before any command imports torch
        return module.main(args) or 0
    except ValueError as e:
        path = [args.command, *(getattr(args, f"command_{d}") for d in range(1, 4) if hasattr(args, f"command_{d}"))]
        print(f"k3ray {' '.join(path)}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
