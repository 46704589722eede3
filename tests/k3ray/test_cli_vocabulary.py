"""One CLI vocabulary: every flag of every command has help, `--help` is fast and imports no
torch, `--model` is the checkpoint and `--served-model-name` the API name wherever both exist,
`--threads` everywhere, and clients read $K3RAY_API_KEY with $OPENAI_API_KEY as fallback."""

import argparse
import json
import subprocess
import sys

import pytest

from k3ray import threads
from k3ray.cli import build_parser, registry

EVAL_SUITES = ("niah", "ruler", "mm", "lm-eval")
NO_HELP_NEEDED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def command_paths() -> list[tuple[str, ...]]:
    paths = [(name,) for name in registry("k3ray.commands") if name not in ("bench", "eval")]
    paths += [("bench", name) for name in registry("k3ray.benchmarks")]
    return paths + [("eval", suite) for suite in EVAL_SUITES]


def leaf_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(list(path))
    for word in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_every_flag_has_help(path):
    parser = leaf_parser(path)
    missing = [a.option_strings or a.dest for a in parser._actions if not isinstance(a, NO_HELP_NEEDED) and not a.help]
    assert not missing, f"k3ray {' '.join(path)}: flags without help: {missing}"


HELP_PROBE = """
import sys, time
start = time.perf_counter()
from k3ray.cli import main
try:
    main(sys.argv[1:] + ["--help"])
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted(m for m in ("torch", "ray", "transformers", "lm_eval") if m in sys.modules)
print(json.dumps({"seconds": time.perf_counter() - start, "heavy": heavy}), file=sys.stderr)
"""


def help_run(path, tmp_path) -> dict:
    run = subprocess.run([sys.executable, "-c", "import json" + HELP_PROBE, *path], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)  # off the repository root: the installed package
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage: k3ray" in run.stdout
    return json.loads(run.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_help_is_fast_and_imports_no_torch(path, tmp_path):
    probe = help_run(path, tmp_path)
    assert probe["heavy"] == [], f"k3ray {' '.join(path)} --help imports {probe['heavy']}"
    if probe["seconds"] >= 1.0:  # one retry: a busy machine can stall a single run
        probe = help_run(path, tmp_path)
    assert probe["seconds"] < 1.0, f"k3ray {' '.join(path)} --help took {probe['seconds']:.2f} s"


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


def test_threads_everywhere_and_no_torch_threads():
    for path in [("generate",), ("serve",), ("eval", "niah"), ("bench", "serve"), ("bench", "model"),
                 ("bench", "engine"), ("bench", "kernels"), ("bench", "layer")]:
        flags = {flag for action in leaf_parser(path)._actions for flag in action.option_strings}
        assert "--threads" in flags and "--torch-threads" not in flags, path


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
