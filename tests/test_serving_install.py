"""A serving install (`pip install k3ray`, no extra) serves: the eval-only packages are in the `eval`
extra, test tooling in `test`, and with the eval packages hidden from imports every serving module
imports, `k3ray info`, `plan`, `generate` and `serve --print-config` run, and `k3ray eval` (and
bench serve's long dataset, read through `datasets`) ends with one line naming the extra."""

import json
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from k3ray.evals.extra import EVAL_MODULES, INSTALL, missing_eval_modules

ROOT = Path(__file__).resolve().parents[1]
# tqdm is in the extra (the evals import it) but not hidden here: every install has it through
# xgrammar -> transformers
HIDDEN = ("datasets", "lm_eval", "matplotlib")
TOOLING = {"pytest", "openai", "hypothesis", "schemathesis", "build", "transformers", "fla-core"}

# runs in a fresh interpreter: path-based imports of HIDDEN find nothing, as where they are not installed
WITHOUT_EVAL_EXTRA = f"""
import sys
from importlib.machinery import PathFinder

class WithoutEvalExtra(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {HIDDEN!r}:
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [WithoutEvalExtra if finder is PathFinder else finder for finder in sys.meta_path]
"""

SERVING = """
import contextlib, importlib, io, json, pkgutil, sys
import importlib.util

assert all(importlib.util.find_spec(name) is None for name in {hidden!r})  # the hook works

def serving_modules(package):
    yield package
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        # a wheel holds k3ray.evals under k3ray/: a serving install runs none of it (bench serve's long
        # dataset reads its corpus through k3ray.evals.haystack, imported by the benchmark)
        if not info.name.startswith("k3ray.evals."):
            yield info.name

failed = {{}}
for package in ("k3ray", "k3ray.actors", "k3ray.kernels"):
    for name in serving_modules(package):
        try:
            importlib.import_module(name)
        except ImportError as e:
            failed[name] = repr(e)

from k3ray.cli import main

runs = {{}}
for argv in (["info"], ["plan"], ["serve", "--print-config"], ["generate", "--max-tokens", "2"],
             ["eval", "niah", "--oracle", "right", "--out", {out!r}]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    runs[" ".join(argv)] = {{"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}}
from k3ray.actors.bench.serve.datasets import long_requests, random_requests

assert len(random_requests(2, 8, 4, (0, 200))) == 2  # bench serve's default dataset
try:
    long_requests(2, 8, 4, tokenize=lambda text: list(text.encode()))
    long_error = None
except ValueError as e:
    long_error = str(e)
print(json.dumps({{"failed": failed, "runs": runs, "long_error": long_error, "loaded": sorted(set(sys.modules) & set({hidden!r}))}}))
"""


def test_dependencies_are_split_by_use():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {Requirement(r).name for r in reqs}  # noqa: E731
    serving, extras = names(project["dependencies"]), project["optional-dependencies"]
    assert names(extras["eval"]) == {"datasets", "lm-eval", "matplotlib", "tqdm"}  # EVAL_MODULES' distributions
    assert len(EVAL_MODULES) == len(extras["eval"])
    assert not serving & (names(extras["eval"]) | TOOLING)
    assert TOOLING <= names(extras["test"]) and "k3ray[eval]" in extras["test"]  # the suite runs the evals
    assert "[eval" in (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("\n", 1)[0]  # the install


def test_this_install_has_the_eval_extra():
    assert missing_eval_modules() == []


def test_serving_runs_without_the_eval_extra(tmp_path):
    script = WITHOUT_EVAL_EXTRA + SERVING.format(hidden=HIDDEN, out=str(tmp_path / "eval"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["failed"] == {}
    assert report["loaded"] == []
    runs = report["runs"]
    for command in ("info", "plan", "serve --print-config", "generate --max-tokens 2"):
        assert runs[command]["rc"] == 0 and runs[command]["stdout"], (command, runs[command])
    assert "k3ray serve --print-config" in runs["serve --print-config"]["stdout"]
    evaluated = next(run for command, run in runs.items() if command.startswith("eval"))
    assert evaluated["rc"] == 2 and evaluated["stdout"] == ""
    assert evaluated["stderr"].count("\n") == 1, evaluated["stderr"]
    line = evaluated["stderr"]
    assert line.startswith("k3ray eval: error: ") and INSTALL in line
    assert all(name in line for name in HIDDEN) and "tqdm" not in line, line
    assert not (tmp_path / "eval").exists()
    assert report["long_error"] == f"--dataset long needs the eval extra (datasets not installed): {INSTALL}"
