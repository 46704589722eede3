"""Shared by the k3-tiny-niah score tests: one grid run, returning scores and predictions, and whether
the build holds the trained checkpoint (its tests skip until it is trained into the package)."""

import json

import pytest

from k3ray.checkpoints import shipped_checkpoint_dir
from k3ray.evals.runner import RunConfig, run_eval

DEPTHS = (0.0, 50.0, 100.0)
# the bar (exact match, 3 depths x 10 samples, seed 0): the shipped checkpoint measured
# 1.00 / 1.00 / 1.00 here, and a broken pipeline scores 0
NIAH_FLOORS = {1024: 0.95, 2048: 0.95, 4096: 0.95}


@pytest.fixture(scope="session")
def niah_floors() -> dict[int, float]:
    """length -> the lowest niah exact match the shipped k3-tiny-niah may score."""
    return NIAH_FLOORS


@pytest.fixture(scope="session")
def trained_checkpoint() -> str:
    """The shipped k3-tiny-niah's name; its tests skip until it is trained into the package."""
    try:
        shipped_checkpoint_dir("k3-tiny-niah")
    except ValueError as e:
        pytest.skip(str(e))
    return "k3-tiny-niah"


@pytest.fixture(scope="session")
def trained_grid():
    """`trained_grid(target, out, task, lengths, samples)` -> (exact match per length, prediction per
    cell key): `task` at `lengths` x depths 0/50/100 x `samples`, seed 0, no failed cell."""

    def run(target, out, task: str, lengths: tuple[int, ...], samples: int):
        config = RunConfig((task,), lengths, DEPTHS, samples, seed=0, concurrency=8, executor="threads")
        summary = run_eval(config, target, out, progress=False)
        records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        assert [r["error"] for r in records if r["error"]] == []
        return {int(n): s for n, s in summary["by_length"].items()}, {r["key"]: r["prediction"] for r in records}

    return run
