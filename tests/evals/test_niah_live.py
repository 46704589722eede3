"""`k3ray eval niah` end to end through the live Serve app (tiny K3, loopback), and EngineTarget:
the same grid on the replica's engine rebuilt in this process gives the same records.

The 1,048,576-token cell is `slow` (not in default CI): on the tiny model on 2 CPU cores its
prefill is quadratic (3 MLA layers attend to the whole context): the same cell through
`k3ray eval niah --model` took 3,296 s at 2.37 GiB peak RSS (README, "Measured")."""

import json

import pytest

from k3ray.cli import main as k3ray_main
from k3ray.evals import progress
from k3ray.evals.engine_target import EngineTarget
from k3ray.evals.openai_target import OpenAITarget
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.runner import RunConfig, run_eval
from k3ray.evals.tasks import get_task
from k3ray.evals.tasks.base import Cell

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-niah"
LENGTHS, DEPTHS = (512, 1024), (0.0, 50.0, 100.0)
RECORD_FIELDS = ("prompt_sha256", "prompt_tokens", "needle_depth", "answers", "max_tokens", "prediction", "score")
REPORT_FILES = {"results.jsonl", "config.json", "summary.json", "heatmap.png", "report.md", "report.html"}



def serve_args(checkpoint: str) -> dict:
    return {"model": {"model": checkpoint}, "server": {"served_model_name": MODEL},
            "engine": {"max_model_len": 2048, "cache_memory_mb": 32}}


@pytest.fixture(scope="module")
def server(serve_app, k2_tiny_checkpoint):
    return serve_app(serve_args(k2_tiny_checkpoint))


@pytest.fixture(scope="module")
def endpoint_run(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("niah_live")
    rc = k3ray_main(["eval", "niah", "--endpoint", server, "--served-model-name", MODEL, "--lengths", "512,1k",
                     "--depths", "0,50,100", "--out", str(out), "--executor", "threads", "--concurrency", "6",
                     "--no-progress"])
    return rc, out


def records(out) -> dict[str, dict]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["key"]: r for r in rows}


def test_a_niah_grid_runs_through_the_live_serve_app(endpoint_run):
    rc, out = endpoint_run
    assert rc == 0
    assert {p.name for p in out.iterdir()} == REPORT_FILES
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lengths"] == list(LENGTHS) and summary["depths"] == list(DEPTHS)
    assert summary["n"] == 6 and summary["errors"] == 0
    assert len(summary["grid"]) == 2 and all(len(row) == 3 for row in summary["grid"])
    assert all(0.0 <= v <= 1.0 for row in summary["grid"] for v in row)
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got = records(out)
    assert sorted(r["prompt_tokens"] for r in got.values()) == sorted(LENGTHS * 3)
    assert all(r["error"] is None and isinstance(r["prediction"], str) for r in got.values())
    assert any(r["prediction"] for r in got.values())  # the random model may end a completion at once (EOS first)


def test_progress_against_the_endpoint_follows_the_servers_token_counters(server, tmp_path, monkeypatch):
    """The server's /metrics counts prompt (prefill chunks as they run), prefix-hit and generated
    tokens; the eval's bar follows them in tokens and ends at the grid's total."""
    target = OpenAITarget(server, MODEL)
    prompt = "The needle is somewhere in here. " * 40
    before = target.tokens_computed()
    assert before is not None
    target.complete(prompt, 4)
    assert target.tokens_computed() - before >= len(target.tokenize(prompt))
    monkeypatch.setattr(progress, "POLL_S", 0.01)
    updates = []
    config = RunConfig(tasks=("niah",), lengths=(1024,), depths=(25.0,), concurrency=1, executor="threads")
    run_eval(config, target, tmp_path, progress=False, on_progress=lambda *u: updates.append(u))
    total = 1024 + get_task("niah").max_tokens
    assert updates[0] == (0, total, 0) and updates[-1] == (total, total, 1)


@pytest.fixture(scope="module")
def local_target(k2_tiny_checkpoint) -> EngineTarget:
    """The replica's engine, built in this process with the served settings."""
    from k3ray.actors.serve.config import ServeArgs
    from k3ray.actors.serve.engine import build_engine

    engine, _ = build_engine(ServeArgs.model_validate(serve_args(k2_tiny_checkpoint)).resolved())
    return EngineTarget(engine)


def test_engine_target_gives_the_endpoints_records(endpoint_run, local_target, tmp_path):
    _, out = endpoint_run
    config = RunConfig(tasks=("niah",), lengths=LENGTHS, depths=DEPTHS, concurrency=6, executor="threads")
    summary = run_eval(config, local_target, tmp_path, progress=False)
    assert summary["errors"] == 0
    served, local = records(out), records(tmp_path)
    assert served.keys() == local.keys()
    for key in served:
        # greedy fp32 on the same engine settings: token for token the same answer
        assert {f: local[key][f] for f in RECORD_FIELDS} == {f: served[key][f] for f in RECORD_FIELDS}, key


def test_chat_items_through_the_endpoint_are_the_cell_s_length_and_answer_as_the_engine(server, local_target,
                                                                                       tmp_path):
    """`--chat`: the server's chat template (/tokenize with messages) makes each prompt the cell's
    length, and /v1/chat/completions answers as the engine given the same chat ids."""
    config = RunConfig(tasks=("niah", "vt"), lengths=(768,), depths=(0.0, 100.0), chat=True, template="ruler",
                       concurrency=4, executor="threads")
    for target, out in ((OpenAITarget(server, MODEL), tmp_path / "served"), (local_target, tmp_path / "local")):
        assert run_eval(config, target, out, progress=False)["errors"] == 0
    served, local = records(tmp_path / "served"), records(tmp_path / "local")
    assert {r["prompt_tokens"] for r in served.values()} == {768}
    assert all(r["prediction"] for r in served.values())
    assert {k: {f: r[f] for f in RECORD_FIELDS} for k, r in served.items()} == \
        {k: {f: r[f] for f in RECORD_FIELDS} for k, r in local.items()}


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_a_million_token_niah_cell_on_the_tiny_model(k2_tiny_checkpoint, tmp_path, request):
    if "slow" not in request.config.getoption("markexpr", ""):
        pytest.skip("an hour of CPU: runs only when selected with -m slow")  # nothing in conftest skips `slow`
    from k3ray.engine import LLM

    length = 1_048_576
    llm = LLM(k2_tiny_checkpoint, max_model_len=length, cache_memory_bytes=1024**3, max_num_seqs=1,
              max_num_batched_tokens=8192)
    target = EngineTarget(llm)
    config = RunConfig(tasks=("niah",), lengths=(length,), depths=(50.0,), reserve_generation=True,
                       concurrency=1, executor="threads")
    summary = run_eval(config, target, tmp_path, progress=False)
    (record,) = records(tmp_path).values()
    assert summary["errors"] == 0 and record["error"] is None, record.get("error")
    task = get_task("niah")
    assert record["prompt_tokens"] == length - task.max_tokens
    item = task.build(Cell("niah", length, 50.0), target, 0, reserve_generation=True)
    assert len(target.tokenize(item.prompt)) == length - task.max_tokens
    assert OracleTarget().read(item.prompt) == ", ".join(record["answers"])


def test_eval_cli_with_a_checkpoint_gives_the_endpoints_records(endpoint_run, k2_tiny_checkpoint, tmp_path, capsys):
    _, out = endpoint_run
    rc = k3ray_main(["eval", "niah", "--model", k2_tiny_checkpoint, "--lengths", "512", "--depths", "0,100",
                     "--max-model-len", "2048", "--cache-memory-mb", "32", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0, capsys.readouterr()
    served, local = records(out), records(tmp_path)
    assert len(local) == 2 and local.keys() <= served.keys()
    for key in local:
        assert {f: local[key][f] for f in RECORD_FIELDS} == {f: served[key][f] for f in RECORD_FIELDS}, key
