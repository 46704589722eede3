"""The multimodal needle tasks end to end against the live Serve app on loopback: every cell's chat
request (PNG image parts, video frames, an animated GIF video) is answered and recorded. The tiny
model reads randomly, so only completion is checked, not accuracy."""

import json

import pytest

from k3ray.evals.openai_target import OpenAITarget
from k3ray.evals.results import load_records
from k3ray.evals.runner import RunConfig, run_eval

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-mm"
TASKS = ("image_niah", "video_niah", "video_niah_gif")
LENGTHS = (1, 4)
DEPTHS = (0.0, 100.0)



@pytest.fixture(scope="module")
def server(serve_app, tiny_checkpoint):
    return serve_app(
        {"model": {"model": tiny_checkpoint}, "server": {"served_model_name": MODEL},
         "engine": {"max_model_len": 2048, "cache_memory_mb": 16, "max_num_seqs": 4}}
    )


def test_multimodal_needles_run_end_to_end(server, tmp_path):
    config = RunConfig(tasks=TASKS, lengths=LENGTHS, depths=DEPTHS, concurrency=4, executor="threads")
    summary = run_eval(config, OpenAITarget(server, MODEL, timeout=120), tmp_path, progress=False)
    records = load_records(tmp_path / "results.jsonl")
    assert len(records) == len(TASKS) * len(LENGTHS) * len(DEPTHS)
    for key, record in records.items():
        assert record["error"] is None, (key, record["error"])
        assert isinstance(record["prediction"], str) and record["score"] in (0.0, 1.0)
        assert record["prompt_tokens"] > record["length"]  # the server's count, each image's tokens included
    assert {r["task"] for r in records.values()} == set(TASKS)
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))
