"""Eval progress in tokens: a long cell's prefill moves the bar while it runs (in process here;
against an endpoint in test_niah_live.py), a finished cell counts in full, the bar never passes the
cells started, and a target without a token count moves a cell at a time."""

import pytest

from k3ray.engine import LLM
from k3ray.evals import progress
from k3ray.evals.engine_target import EngineTarget
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.progress import TokenProgress
from k3ray.evals.runner import RunConfig, run_eval
from k3ray.evals.tasks import get_task

pytestmark = pytest.mark.timeout(300)


def test_a_long_cells_prefill_moves_the_bar_in_process(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "POLL_S", 0.01)
    # 128-token prefill chunks: a 2,048-token prompt takes 16 steps
    llm = LLM(tiny_checkpoint, max_model_len=4096, max_num_batched_tokens=128, cache_memory_bytes=32 * 1024**2,
              enable_prefix_caching=False)
    updates = []
    config = RunConfig(tasks=("niah",), lengths=(2048,), depths=(50.0,), concurrency=1, executor="threads")
    summary = run_eval(config, EngineTarget(llm), tmp_path, progress=False,
                       on_progress=lambda *u: updates.append(u))
    assert summary["errors"] == 0
    total = 2048 + get_task("niah").max_tokens
    assert updates[-1] == (total, total, 1)
    during = sorted({shown for shown, _, cells in updates if cells == 0 and 0 < shown < total})
    assert len(during) >= 4, f"the bar did not move during the cell: {updates}"
    assert all(b >= a for (a, _, _), (b, _, _) in zip(updates, updates[1:])), "the bar went backwards"


def test_a_target_without_a_token_count_moves_a_cell_at_a_time(tmp_path):
    updates = []
    config = RunConfig(tasks=("niah",), lengths=(1024, 2048), depths=(0.0,), concurrency=1, executor="threads")
    run_eval(config, OracleTarget(), tmp_path, progress=False, on_progress=lambda *u: updates.append(u))
    cell = get_task("niah").max_tokens
    assert {shown for shown, _, _ in updates} == {0, 1024 + cell, 1024 + 2048 + 2 * cell}


def test_finished_cells_count_in_full_and_the_bar_stays_within_the_cells_started():
    computed = [0]
    updates = []
    with TokenProgress({"a": 100, "b": 100}, lambda: computed[0], enabled=False,
                       on_update=lambda *u: updates.append(u[0])) as bar:
        bar.started("a")
        computed[0] = 60
        bar._show()
        computed[0] = 500  # another client's work on the same server: no further than cell a
        bar._show()
        computed[0] = 60
        bar.finished("a")  # a prefix-cache hit left 40 tokens uncomputed: a counts as 100
        bar.started("b")
        computed[0] = 90
        bar._show()
        bar.finished("b")
    assert updates == [0, 0, 60, 100, 100, 100, 130, 200]
