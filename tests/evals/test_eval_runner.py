"""The run loop: oracle scores end to end, resume, failures, context checks, JSONL task files."""

import dataclasses
import json
import threading

import pytest

from k3ray.evals.oracle import OracleTarget
from k3ray.evals.runner import RunConfig, run_eval
from k3ray.evals.tasks import TASKS, Cell

GRID = RunConfig(tasks=("niah", "niah_multikey_1", "vt"), lengths=(1024, 2048), depths=(0.0, 50.0, 100.0),
                 concurrency=3)
CELLS = 3 * 2 * 3


class _CountingOracle(OracleTarget):
    def __init__(self, fail_when=(), **kwargs):
        super().__init__(**kwargs)
        self.completions = 0
        self.fail_when = fail_when
        self._lock = threading.Lock()

    def complete(self, prompt, max_tokens):
        with self._lock:
            self.completions += 1
        if any(marker in prompt for marker in self.fail_when):
            raise ConnectionError("server went away")
        return super().complete(prompt, max_tokens)


def _run(tmp_path, target, config=GRID, **kwargs):
    # counting oracles live in this process: keep cells off any Ray cluster another test started
    config = dataclasses.replace(config, executor="threads")
    return run_eval(config, target, tmp_path / "run", progress=False, **kwargs)


def test_right_oracle_scores_100_on_every_cell(tmp_path):
    summary = _run(tmp_path, OracleTarget())
    assert summary["accuracy"] == 1.0 and summary["n"] == CELLS and summary["errors"] == 0
    assert summary["lengths"] == [1024, 2048] and summary["depths"] == [0.0, 50.0, 100.0]
    assert summary["grid"] == [[1.0] * 3] * 2
    records = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert len(records) == CELLS and {r["prompt_tokens"] for r in records} == {1024, 2048}


def test_wrong_oracle_scores_0_on_every_cell(tmp_path):
    summary = _run(tmp_path, OracleTarget(wrong=True))
    assert summary["accuracy"] == 0.0 and summary["grid"] == [[0.0] * 3] * 2 and summary["errors"] == 0


def test_rerun_skips_finished_cells_and_gives_the_same_summary(tmp_path):
    target = _CountingOracle()
    first = _run(tmp_path, target)
    assert target.completions == CELLS
    again = _run(tmp_path, target, resume=True)
    assert target.completions == CELLS and again == first

    log = tmp_path / "run" / "results.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:7]) + "\n" + lines[7][:25])  # as if killed mid-write
    resumed = _run(tmp_path, target, resume=True)
    assert target.completions == 2 * CELLS - 7
    assert resumed == first
    assert (tmp_path / "run" / "summary.json").read_text() == json.dumps(first, indent=2) + "\n"


def test_failed_cells_are_recorded_and_retried_on_resume(tmp_path):
    flaky = _CountingOracle(fail_when=("variable assignment",))  # the vt prompts, in either wording
    summary = _run(tmp_path, flaky)
    assert summary["errors"] == 6 and summary["n"] == 12 and summary["accuracy"] == 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert {r["error"] for r in records if r["task"] == "vt"} == {"ConnectionError: server went away"}
    fixed = _CountingOracle()
    summary = _run(tmp_path, fixed, resume=True)
    assert fixed.completions == 6 and summary["errors"] == 0 and summary["n"] == CELLS


def test_existing_results_need_resume_and_the_same_seed(tmp_path):
    _run(tmp_path, OracleTarget(), RunConfig(tasks=("niah",), lengths=(1024,), depths=(50.0,)))
    with pytest.raises(ValueError, match="--resume"):
        _run(tmp_path, OracleTarget(), RunConfig(tasks=("niah",), lengths=(1024,), depths=(50.0,)))
    with pytest.raises(ValueError, match="seed"):
        _run(tmp_path, OracleTarget(), RunConfig(tasks=("niah",), lengths=(1024,), depths=(50.0,), seed=3),
             resume=True)


def test_grid_can_grow_on_resume(tmp_path):
    target = _CountingOracle()
    _run(tmp_path, target, RunConfig(tasks=("niah",), lengths=(1024,), depths=(50.0,)))
    summary = _run(tmp_path, target, RunConfig(tasks=("niah",), lengths=(1024, 2048), depths=(0.0, 50.0)),
                   resume=True)
    assert target.completions == 4 and summary["n"] == 4 and summary["lengths"] == [1024, 2048]


def test_lengths_beyond_the_context_are_refused_before_running(tmp_path):
    target = _CountingOracle(max_context=2048)
    with pytest.raises(ValueError, match="serves at most 2048"):
        _run(tmp_path, target, RunConfig(tasks=("niah",), lengths=(2048,), depths=(50.0,)))
    summary = _run(tmp_path, target, RunConfig(tasks=("niah",), lengths=(2048,), depths=(50.0,),
                                               reserve_generation=True))
    assert summary["accuracy"] == 1.0 and target.completions == 1


def test_random_depths_give_a_length_only_summary(tmp_path):
    summary = _run(tmp_path, OracleTarget(), RunConfig(tasks=("niah_single_1", "cwe"), lengths=(2048,), samples=2))
    assert summary["depths"] == [] and summary["grid"] == [[]] and summary["by_length"] == {"2048": 1.0}
    assert summary["n"] == 4 and summary["tasks"]["cwe"]["n"] == 2


def test_jsonl_task_file_is_read_through_datasets(tmp_path):
    rows = []
    for name, length, depth in [("niah", 900, 10.0), ("niah_multivalue", 1100, 90.0), ("image_niah", 3, 50.0)]:
        item = TASKS[name].build(Cell(name, length, depth), OracleTarget(), 7)
        rows.append({"input": item.prompt, "outputs": list(item.answers), "length": length, "depth": depth})
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for wrong, expected in ((False, 1.0), (True, 0.0)):
        config = RunConfig(tasks=(), lengths=(1,), task_files=(str(path),), executor="threads")
        summary = run_eval(config, OracleTarget(wrong=wrong), tmp_path / f"jsonl-{wrong}", progress=False)
        assert summary["accuracy"] == expected and summary["n"] == 3
        assert summary["lengths"] == [3, 900, 1100] and summary["depths"] == [10.0, 50.0, 90.0]


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="depths"):
        RunConfig(tasks=("niah",), lengths=(1024,), depths=(120.0,))
    with pytest.raises(ValueError, match="executor"):
        RunConfig(tasks=("niah",), lengths=(1024,), executor="slurm")
    with pytest.raises(ValueError, match="unknown task"):
        _run(tmp_path, OracleTarget(), RunConfig(tasks=("needle",), lengths=(1024,)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": "hello", "outputs": "not a list"}) + "\n")
    with pytest.raises(ValueError, match="list of strings"):
        _run(tmp_path, OracleTarget(), RunConfig(tasks=(), lengths=(1,), task_files=(str(bad),)))
