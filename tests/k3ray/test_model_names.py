"""A mistyped `--model` name ends every command that takes one before torch is imported, naming the
models k3ray knows and the closest; the default tiny K3's own name loads it."""

import argparse
import json
import re
import subprocess
import sys

import pytest

from k3ray import default_model
from k3ray.checkpoints import SHIPPED
from k3ray.cli import build_parser
from k3ray.config import k3_tiny_config
from k3ray.default_model import DEFAULT_NAME
from k3ray.model_names import CHECKPOINT, CONFIG, check_model_name
from k3ray.model_source import model_config

TYPO = "k3-tiny-nia"


def test_known_names_paths_and_existing_folders_pass(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in (DEFAULT_NAME, *SHIPPED, "/models/kimi-k3", "./not-here", "~/ckpt"):
        check_model_name(name, CHECKPOINT)
    for name in ("k3", "k3-tiny", "k3-micro", DEFAULT_NAME, *SHIPPED):
        check_model_name(name, CONFIG)
    (tmp_path / "my-ckpt").mkdir()
    check_model_name("my-ckpt", CHECKPOINT)


def test_a_typo_names_the_known_models_and_the_closest():
    with pytest.raises(ValueError) as e:
        check_model_name(TYPO, CHECKPOINT)
    message = str(e.value)
    assert all(name in message for name in (DEFAULT_NAME, *SHIPPED)) and "did you mean k3-tiny-niah?" in message
    assert "preset" not in message
    with pytest.raises(ValueError, match=r"k3, k3-tiny, k3-micro \(presets\).*did you mean k3-tiny\?"):
        check_model_name("k3-tni", CONFIG)


def test_a_preset_is_no_checkpoint():
    with pytest.raises(ValueError, match="k3-tiny is a preset, which only info, plan"):
        check_model_name("k3-tiny", CHECKPOINT)


def test_the_default_name_loads_the_default_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "default_checkpoint_dir", lambda: "the default")
    monkeypatch.chdir(tmp_path)
    assert default_model.checkpoint_dir(DEFAULT_NAME) == "the default"
    assert model_config(DEFAULT_NAME) == k3_tiny_config()
    (tmp_path / DEFAULT_NAME).mkdir()
    (tmp_path / DEFAULT_NAME / "config.json").write_text("{}")
    assert default_model.checkpoint_dir(DEFAULT_NAME) == DEFAULT_NAME  # a checkpoint here: the user's own


def _subparsers(parser: argparse.ArgumentParser):
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def model_commands(path: tuple[str, ...] = ()) -> list[list[str]]:
    """argv of every command taking a free-form --model (not a fixed list of choices), with the
    typo and a value for each other required flag."""
    parser = build_parser(list(path))
    for word in path:
        parser = _subparsers(parser).choices[word]
    sub = _subparsers(parser)
    if sub is not None:
        return [argv for name in sub.choices for argv in model_commands((*path, name))]
    model = next((a for a in parser._actions if "--model" in a.option_strings), None)
    if model is None or model.choices:
        return []
    required = [w for a in parser._actions if a.required and a.option_strings for w in (a.option_strings[0], "x")]
    return [[*path, "--model", TYPO, *required]]


def test_every_command_taking_a_model_refuses_a_typo_before_importing_torch(tmp_path):
    commands = model_commands()
    assert {" ".join(argv[:2]) for argv in commands} >= {
        "generate --model", "serve --model", "info --model", "plan --model", "eval niah", "eval lm-eval",
        "bench model", "bench engine", "bench layer", "bench cluster", "bench serve", "bench soak"}
    code = ("import contextlib, io, json, sys\nfrom k3ray.cli import main\nout = []\n"
            "for argv in json.loads(sys.argv[1]):\n    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err):\n        rc = main(argv)\n"
            "    out.append([argv, rc, err.getvalue(), 'torch' in sys.modules])\nprint(json.dumps(out))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for argv, rc, err, torch_loaded in json.loads(done.stdout.splitlines()[-1]):
        assert rc == 2 and not torch_loaded, (argv, rc, err, torch_loaded)
        assert f"--model '{TYPO}'" in err and "did you mean k3-tiny-niah?" in err, (argv, err)
        assert all(name in err for name in (DEFAULT_NAME, *SHIPPED)), (argv, err)


def test_the_command_line_fails_with_the_names_and_no_torch(tmp_path):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "k3ray.cli", "generate", "--model", TYPO],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    error = [line for line in done.stderr.splitlines() if line.startswith("k3ray generate: error:")]
    assert error and "k3-tiny-niah, k3-tiny-vl (shipped)" in error[0], done.stderr[-2000:]
    imported = re.findall(r"^import time:.*\|\s+(\S+)$", done.stderr, re.M)
    assert "k3ray.model_names" in imported and "torch" not in imported
