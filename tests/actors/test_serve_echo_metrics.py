"""The OpenAI app in process (no Ray): an echo-only request (max_tokens=0) generates nothing the
client sees, and /metrics' generation_tokens agrees with the usage; /tokenizer_info carries the
chat template Hugging Face clients render with."""

import pytest
from fastapi.testclient import TestClient

from k3ray.actors.openai.routes import build_openai_app
from k3ray.actors.openai.serving import OpenAIServing
from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import build_engine
from k3ray.actors.serve.metrics import ServeMetrics
from k3ray.engine.async_engine import AsyncEngine

MODEL = "k3-echo"
GENERATED = f'k3ray:generation_tokens_total{{model_name="{MODEL}"}}'


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    args = ServeArgs.model_validate({
        "model": {"model": tiny_checkpoint}, "server": {"served_model_name": MODEL},
        "engine": {"max_model_len": 128, "cache_memory_mb": 16, "max_num_seqs": 4}}).resolved()
    engine, _ = build_engine(args)
    async_engine = AsyncEngine(engine)
    metrics = ServeMetrics(MODEL, async_engine.get_stats)
    app = build_openai_app(OpenAIServing(async_engine, engine.tokenizer, MODEL, metrics), metrics=metrics)
    with TestClient(app) as c:
        yield c


def generated_total(client) -> float:
    line = next(line for line in client.get("/metrics").text.splitlines() if line.startswith(GENERATED))
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_only_requests_add_no_generation_tokens(client, stream):
    before = generated_total(client)
    body = {"model": MODEL, "prompt": ["echo me", "and me"], "max_tokens": 0, "echo": True, "logprobs": 1,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        usage = [line for line in response.text.splitlines() if '"usage"' in line][-1]
        assert '"completion_tokens": 0' in usage or '"completion_tokens":0' in usage
    else:
        assert response.json()["usage"]["completion_tokens"] == 0
    assert generated_total(client) == before
    client.post("/v1/completions", json={"model": MODEL, "prompt": "then", "max_tokens": 3, "ignore_eos": True})
    assert generated_total(client) == before + 3


def test_tokenizer_info_names_the_chat_format(client):
    """The default tiny K3 speaks K3's XTML, which has no Jinja template (as K3's release tokenizer)."""
    info = client.get("/tokenizer_info").json()
    assert info["chat_format"] == "kimi_k3_xtml" and info["chat_template"] is None
    assert "<|open|>" in info["special_tokens"] and "<|end_of_msg|>" in info["special_tokens"]
    (card,) = client.get("/v1/models").json()["data"]
    assert card["chat_format"] == "kimi_k3_xtml"
