"""The rules every `k3ray` parser follows (docs/cli.md is the vocabulary): defaults shown in
`--help`, and old spellings kept as hidden aliases that warn. Torch-free, so `--help` stays fast.

    add_deprecated_alias(p, "--preset", "--model", dest="model")   # hidden; warns when used
    show_defaults(parser)   # once, on the whole tree: build_parser does it
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

_NO_DEFAULT = (None, False, "", [], (), argparse.SUPPRESS)
_ACTIONS = {"store": argparse._StoreAction, "store_const": argparse._StoreConstAction,
            "store_true": argparse._StoreTrueAction, "append": argparse._AppendAction}


def add_deprecated_alias(parser: argparse.ArgumentParser | argparse._ActionsContainer, old: str, new: str,
                         action: str = "store", **kwargs: Any) -> argparse.Action:
    """`old` as a hidden flag doing what `new` does (same dest), with a warning on stderr when used."""
    base = _ACTIONS[action]

    class DeprecatedAlias(base):  # type: ignore[valid-type, misc]
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"warning: {option_string} is deprecated; use {new}", file=sys.stderr)
            super().__call__(parser, namespace, values, option_string)

    alias = parser.add_argument(old, action=DeprecatedAlias, help=argparse.SUPPRESS, **kwargs)
    alias.deprecated_for = new  # read by tests/k3ray/test_cli_vocabulary.py
    return alias


def default_text(default: Any) -> str | None:
    """How a default reads in `--help` (None: nothing to show; the help says what absence means)."""
    if any(default is d or (type(default) is type(d) and default == d) for d in _NO_DEFAULT):
        return None
    if isinstance(default, (list, tuple)):
        return " ".join(str(v) for v in default)
    return str(default)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append `(default: X)` to every flag's help that has a default and does not state it, in
    `parser` and all its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
            continue
        text = default_text(action.default)
        if action.help in (None, argparse.SUPPRESS) or text is None or "default" in action.help:
            continue
        action.help = f"{action.help} (default: {text.replace('%', '%%')})"
