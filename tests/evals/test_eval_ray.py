"""Cells sharded over Ray tasks give the same records as the thread pool."""

import json

import pytest
import ray

from k3ray.actors.cluster.ray_connect import connect  # ray.init off the repository root
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.runner import RunConfig, run_eval


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():  # another test module's cluster: use it, leave it running
        yield
        return
    # a fresh single-node instance, never a cluster some other process started on this machine
    connect(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _records(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["key"]: (r["prompt_sha256"], r["answers"], r["score"]) for r in records}


def test_ray_shards_match_threads(local_ray, tmp_path):
    grid = dict(tasks=("niah_single_1", "vt"), lengths=(1024, 1500), depths=(0.0, 100.0), concurrency=2)
    on_ray = run_eval(RunConfig(**grid, executor="ray"), OracleTarget(), tmp_path / "ray", progress=False)
    on_threads = run_eval(RunConfig(**grid, executor="threads"), OracleTarget(), tmp_path / "threads",
                          progress=False)
    assert on_ray["n"] == 8 and on_ray["errors"] == 0
    for key in ("accuracy", "grid", "tasks"):
        assert on_ray[key] == on_threads[key]
    assert _records(tmp_path / "ray" / "results.jsonl") == _records(tmp_path / "threads" / "results.jsonl")
