"""Rules that keep the suite failing only on bugs:
- no test bounds how long something took (`assert took < 5`): speed belongs to the benchmarks, and a
  busy machine is no bug. Waiting for something with a generous deadline is fine
  (`while ...: assert time.monotonic() < deadline`), as is a lower bound (a schedule kept);
- no test skips because a package that `k3ray[test]` installs is missing (`pytest.importorskip("ray")`):
  an install that lost one fails. tests/gpu/ alone may skip: it runs on the offline GPU host, where
  k3ray is installed without its dependencies and there is no Ray (tests/gpu/run.sh).
Both rules read the test sources (their syntax trees) and name each offending file:line."""

from __future__ import annotations

import ast
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
MAY_SKIP_ON_IMPORTS = {"gpu"}  # top-level folders of tests/
CLOCKS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"}  # wall clocks
DURATION_NAMES = {"took", "elapsed", "duration", "dt", "seconds", "wall_s", "elapsed_s"}
UPPER = {ast.Lt: "left", ast.LtE: "left", ast.Gt: "right", ast.GtE: "right", ast.Eq: "either", ast.NotEq: "either"}


def source_files() -> list[pathlib.Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _is_clock(node: ast.AST) -> bool:
    """time.monotonic() and the other wall clocks of `time` (CPU time is not one), loop.time()."""
    if not isinstance(node, ast.Call) or node.args or node.keywords:
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in {"monotonic", "perf_counter"}  # from time import monotonic
    if not isinstance(f, ast.Attribute) or f.attr not in CLOCKS:
        return False
    owner = f.value
    if isinstance(owner, ast.Name):
        return owner.id == "time" or owner.id == "loop" and f.attr == "time"
    return isinstance(owner, ast.Call) and isinstance(owner.func, ast.Attribute) and f.attr == "time" and \
        owner.func.attr in {"get_running_loop", "get_event_loop"}


class _Durations:
    """Which expressions of one module are a measured duration: a difference with a clock reading on
    one side (a clock call, or a name once bound to an expression holding one), a name bound to such
    a difference, a name or string key spelled like a duration, or a call over one (float(took))."""

    def __init__(self, tree: ast.Module) -> None:
        bindings = [(t, n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets] + \
                   [(n.target, n.value) for n in ast.walk(tree) if isinstance(n, (ast.AnnAssign, ast.AugAssign))
                    if n.value is not None]
        self.time_points = {t.id for t, v in bindings if isinstance(t, ast.Name) and any(map(_is_clock, ast.walk(v)))}
        self.names = set(DURATION_NAMES)
        for target, value in bindings:
            if isinstance(target, ast.Name) and self.is_duration(value):
                self.names.add(target.id)

    def _time_point(self, node: ast.AST) -> bool:
        return any(_is_clock(n) or isinstance(n, ast.Name) and n.id in self.time_points for n in ast.walk(node))

    def is_duration(self, node: ast.AST) -> bool:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
            return self._time_point(node.left) or self._time_point(node.right)
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Subscript):
            key = node.slice
            return isinstance(key, ast.Constant) and key.value in DURATION_NAMES
        if isinstance(node, ast.Call):
            return any(self.is_duration(a) for a in node.args)
        return False


def timed_asserts(source: str) -> list[int]:
    """Lines of the asserts that bound a measured duration from above (or pin it)."""
    tree = ast.parse(source)
    durations = _Durations(tree)
    lines = set()
    for check in (n for n in ast.walk(tree) if isinstance(n, ast.Assert)):
        for compare in (n for n in ast.walk(check.test) if isinstance(n, ast.Compare)):
            sides = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, sides, sides[1:]):
                side = UPPER.get(type(op))
                if side in ("left", "either") and durations.is_duration(left) or \
                        side in ("right", "either") and durations.is_duration(right):
                    lines.add(compare.lineno)
    return sorted(lines)


def skipped_imports(source: str) -> list[int]:
    """Lines that skip a test when an import fails: pytest.importorskip(...), or pytest.skip(...)
    in an `except ImportError` (or ModuleNotFoundError)."""
    tree = ast.parse(source)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "importorskip":
            lines.append(node.lineno)
        if isinstance(node, ast.ExceptHandler) and node.type is not None and \
                {getattr(n, "id", None) for n in ast.walk(node.type)} & {"ImportError", "ModuleNotFoundError"}:
            lines += [n.lineno for b in node.body for n in ast.walk(b)
                      if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "skip"]
    return sorted(lines)


def _listing(hits: list[tuple[pathlib.Path, int]]) -> str:
    return "\n".join(f"{p.relative_to(TESTS.parent)}:{n}: {p.read_text().splitlines()[n - 1].strip()}"
                     for p, n in hits)


def test_no_test_bounds_how_long_something_took():
    hits = [(p, n) for p in source_files() for n in timed_asserts(p.read_text())]
    assert not hits, ("asserts on how long something took (wait with a generous deadline for what it "
                      "should do instead; speed is the benchmarks' business):\n" + _listing(hits))


def test_no_test_skips_a_package_k3ray_test_installs():
    hits = [(p, n) for p in source_files() if p.relative_to(TESTS).parts[0] not in MAY_SKIP_ON_IMPORTS
            for n in skipped_imports(p.read_text())]
    assert not hits, "skips on a missing import (import it plainly: k3ray[test] installs it):\n" + _listing(hits)


@pytest.mark.parametrize("source", [
    "t0 = time.monotonic()\nrun()\nassert time.monotonic() - t0 < 3",
    "start = time.perf_counter()\nrun()\ntook = time.perf_counter() - start\nassert ok and took < 5, took",
    "line, took, _ = run()\nassert words in line and took < 5",
    "took, imported = out.split()\nassert float(took) < 5",
    "assert probe['seconds'] < 1.0",
    "killed_at = time.monotonic()\nassert events[-1][0] - killed_at < 10",
    "lost = time.monotonic()\nunhealthy_at = time.monotonic() - lost\nassert unhealthy_at <= BOUND_S",
    "assert 5 > time.time() - t0",
    "assert elapsed == pytest.approx(2.0, abs=0.5)",
])
def test_the_rule_finds_a_bound_on_how_long_something_took(source):
    assert timed_asserts(source) == [source.count("\n") + 1]


@pytest.mark.parametrize("source", [
    "deadline = time.monotonic() + 60\nwhile not done():\n    assert time.monotonic() < deadline, 'never done'",
    "while time.monotonic() < deadline:\n    pass",
    "results, duration = run_load()\nassert peak == 3 and duration >= 0.1",  # a schedule kept: a lower bound
    "cpu = time.process_time()\nassert time.process_time() - cpu < 0.5",  # CPU time, not the wall clock
    "assert watch.replica_seconds() == pytest.approx(27.5)",  # a computed figure, not a measurement
    "assert all(latency >= ttft > 0 for latency, ttft in pairs)",
])
def test_the_rule_leaves_deadlines_and_other_comparisons_alone(source):
    assert timed_asserts(source) == []


def test_the_rule_finds_a_skipped_import():
    assert skipped_imports('ray = pytest.importorskip("ray")') == [1]
    assert skipped_imports('try:\n    import ray\nexcept ImportError:\n    pytest.skip("no ray")') == [4]
    assert skipped_imports("import ray\nfrom ray import serve") == []
