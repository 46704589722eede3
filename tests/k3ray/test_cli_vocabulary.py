"""One CLI vocabulary: every parser of `k3ray` (walked recursively) uses only the flags of
docs/cli.md, each in the commands that table names; every flag has help that shows its default;
old spellings are hidden aliases that warn; `--help` imports no torch (nor Ray, Triton, ...); `--model` is
the checkpoint and `--served-model-name` the API name wherever both exist; `--threads` everywhere;
clients read $K3RAY_API_KEY with $OPENAI_API_KEY as fallback."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3ray import threads
from k3ray.cli import build_parser

VOCABULARY = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
NO_HELP_NEEDED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def leaf_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(list(path))  # a command's flags are added only when argv selects it
    for word in path:
        parser = _subparsers(parser).choices[word]
    return parser


def walk(path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command path, parser) of every parser of `k3ray`, the root included, depth first."""
    parser = leaf_parser(path)
    found = [(path, parser)]
    sub = _subparsers(parser)
    for name in sub.choices if sub else ():
        found += walk((*path, name))
    return found


PARSERS = walk()
LEAVES = [path for path, parser in PARSERS if _subparsers(parser) is None]


def flags(parser: argparse.ArgumentParser, hidden: bool) -> dict[str, argparse.Action]:
    return {flag: a for a in parser._actions if not isinstance(a, NO_HELP_NEEDED)
            for flag in a.option_strings if (a.help == argparse.SUPPRESS) == hidden}


def vocabulary(section: str) -> dict[str, tuple[str, set[str]]]:
    """A docs/cli.md table: first column's flag -> (second column, the commands of the third)."""
    text = VOCABULARY.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \| (.+) \| ([a-z, -]+) \|$", text, re.M)
    assert rows, f"no rows in section {section!r} of {VOCABULARY}"
    return {flag: (meaning, {c.strip() for c in commands.split(",")}) for flag, meaning, commands in rows}


def used(hidden: bool) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path, parser in PARSERS:
        for flag in flags(parser, hidden):
            out.setdefault(flag, set()).add(" ".join(path))
    return out


def test_every_flag_is_in_the_vocabulary_with_the_commands_using_it():
    table = {**vocabulary("Flags"), **vocabulary("Serve settings")}
    usage = used(hidden=False)
    outside = sorted(set(usage) - set(table))
    assert not outside, f"flags outside docs/cli.md: {outside} (reuse a row's flag or add a row)"
    stale = sorted(set(table) - set(usage))
    assert not stale, f"docs/cli.md lists flags no command has: {stale}"
    moved = {flag: (sorted(usage[flag]), sorted(table[flag][1])) for flag in usage if usage[flag] != table[flag][1]}
    assert not moved, f"docs/cli.md's commands column is wrong for (used, listed): {moved}"


def test_old_spellings_are_hidden_aliases_that_warn(capsys):
    table = vocabulary("Old spellings")
    usage = used(hidden=True)
    assert set(usage) == set(table), f"hidden flags {sorted(usage)} vs docs/cli.md's old spellings {sorted(table)}"
    for path, parser in PARSERS:
        visible = flags(parser, hidden=False)
        for old, alias in flags(parser, hidden=True).items():
            new = alias.deprecated_for.split()[0]
            assert table[old][0].strip("`") == alias.deprecated_for, old
            assert visible[new].dest == alias.dest, f"k3ray {' '.join(path)}: {old} does not set {new}'s value"
    args = build_parser(["bench", "model"]).parse_args(["bench", "model", "--preset", "k3-micro"])
    assert args.model == "k3-micro" and "--preset is deprecated; use --model" in capsys.readouterr().err
    args = build_parser(["bench", "kernels"]).parse_args(["bench", "kernels", "--tiny"])
    assert args.model == "k3-tiny"


def _shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action)


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_every_flag_has_help_that_shows_its_default(path):
    parser = leaf_parser(path)
    required_groups = [g for g in parser._mutually_exclusive_groups if g.required]
    missing, no_default = [], []
    for action in parser._actions:
        if isinstance(action, NO_HELP_NEEDED) or action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        if not action.help:
            missing.append(action.option_strings[0])
            continue
        chosen_by_hand = action.required or action.nargs == 0 or any(action in g._group_actions for g in required_groups)
        has_default = action.default not in (None, False, [], "")
        shown = _shown_help(parser, action)
        if (has_default or not chosen_by_hand) and "default" not in shown or re.search(r"default: (null|None)\b", shown):
            no_default.append(action.option_strings[0])  # an unset default reads as what it means
    assert not missing, f"k3ray {' '.join(path)}: flags without help: {missing}"
    assert not no_default, f"k3ray {' '.join(path)}: help that does not show the default: {no_default}"


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_json_is_a_file_out_a_folder_and_no_positionals(path):
    parser = leaf_parser(path)
    named = flags(parser, hidden=False)
    assert "--json" not in named or named["--json"].metavar == "PATH" and named["--json"].nargs is None
    assert "--out" not in named or named["--out"].metavar == "DIR"
    shown = [a.dest for a in parser._actions if not a.option_strings and a.help != argparse.SUPPRESS]
    assert not shown, f"k3ray {' '.join(path)}: positional arguments {shown}; the vocabulary is flags"


# what made `--help` slow: each takes seconds to import (how fast it runs is a benchmark's business)
HEAVY = ("torch", "triton", "ray", "transformers", "lm_eval", "datasets", "xgrammar", "matplotlib")
HELP_PROBE = """
import json, sys
from k3ray.cli import main
try:
    main(sys.argv[1:] + ["--help"])
except SystemExit as e:
    assert e.code == 0, e.code
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)), file=sys.stderr)
"""


def heavy_imports(path, tmp_path) -> list[str]:
    """The HEAVY modules `k3ray PATH --help` imports."""
    run = subprocess.run([sys.executable, "-c", HELP_PROBE.format(heavy=HEAVY), *path], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)  # off the repository root: the installed package
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage: k3ray" in run.stdout
    return json.loads(run.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_help_imports_no_torch_nor_anything_heavy(path, tmp_path):
    heavy = heavy_imports(path, tmp_path)
    assert heavy == [], f"k3ray {' '.join(path)} --help imports {heavy}"


@pytest.mark.parametrize("path", [("eval", "niah"), ("eval", "lm-eval"), ("bench", "serve")], ids=" ".join)
def test_model_is_the_checkpoint_and_served_model_name_the_api_name(path):
    endpoint = ["--endpoint", "http://127.0.0.1:9"] if path[0] == "eval" else []
    out = ["--out", "o"] if path == ("eval", "niah") else ["--tasks", "t"] if path == ("eval", "lm-eval") else []
    args = build_parser([*path]).parse_args([*path, "--model", "/ckpt", *out])
    assert args.model == "/ckpt"
    alias = build_parser([*path]).parse_args([*path, "--checkpoint", "/ckpt", *out])
    assert alias.model == "/ckpt"
    served = build_parser([*path]).parse_args([*path, *endpoint, "--served-model-name", "k3", *out])
    assert served.served_model_name == "k3" and served.model is None


def test_threads_wherever_torch_runs_and_no_torch_threads():
    # meta-device sums (info, plan) and reads of Ray's state (cluster, status): no tensor work
    runs_no_torch = {("info",), ("plan",), ("cluster", "env"), ("cluster", "check"), ("status",)}
    for path in LEAVES:
        named = flags(leaf_parser(path), hidden=False)
        assert "--torch-threads" not in named, path
        assert ("--threads" in named) != (path in runs_no_torch), path


def test_thread_default_is_one_on_small_machines(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    assert threads.default_threads() == 1 and threads.resolved_threads(None) == 1 and threads.resolved_threads(3) == 3
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 64)
    assert threads.default_threads() is None
    with pytest.raises(ValueError, match="--threads"):
        threads.resolved_threads(0)


@pytest.mark.parametrize("path", [("eval", "niah"), ("eval", "lm-eval"), ("bench", "serve")], ids=" ".join)
def test_clients_read_k3ray_api_key_then_openai_api_key(path, monkeypatch):
    monkeypatch.delenv("K3RAY_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "openai-key")
    parse = lambda: leaf_parser(path).get_default("api_key")  # noqa: E731
    assert parse() == "openai-key"
    monkeypatch.setenv("K3RAY_API_KEY", "k3ray-key")
    assert parse() == "k3ray-key"
