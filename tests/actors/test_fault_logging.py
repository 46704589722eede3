"""A model that cannot step (every step raises StageFailure, as while a pipeline actor is lost) in the
OpenAI app in process: every request answers a clean 503 (Retry-After, OpenAI body; a stream ends
with an error event), the app does not re-raise the error to the server (which logged a traceback
per request), and the outage is logged once with a count (RepeatLog)."""

import json
import logging

import pytest
from fastapi.testclient import TestClient

from k3ray.actors.openai.routes import build_openai_app
from k3ray.actors.openai.serving import OpenAIServing
from k3ray.actors.pipeline.protocol import StageFailure
from k3ray.engine import AsyncEngine, EngineConfig, LLMEngine, LocalExecutor
from k3ray.repeat_log import RepeatLog
from k3ray.tokenizer import load_tokenizer
from k3ray.weights import load_model

MODEL = "k3-down"


@pytest.fixture(scope="module")
def client(k2_tiny_checkpoint):  # K2's short chat prompt fits the 128-token context
    executor = LocalExecutor(load_model(k2_tiny_checkpoint))

    def lost_stage(plan):
        raise StageFailure("model step failed: an actor of the pipeline died (ActorUnavailableError)")

    executor.execute = lost_stage  # a real engine whose executor has lost a pipeline actor
    engine = LLMEngine(executor, EngineConfig(num_blocks=16, block_size=8, max_model_len=128),
                       load_tokenizer(k2_tiny_checkpoint))
    app = build_openai_app(OpenAIServing(AsyncEngine(engine), engine.tokenizer, MODEL), retry_after_s=2)
    with TestClient(app) as c:  # raises whatever the app re-raises to the server
        yield c


def test_every_request_answers_a_clean_503_and_the_outage_logs_once(client, caplog):
    caplog.set_level(logging.WARNING)
    for i in range(12):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": f"request {i}", "max_tokens": 4})
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        assert r.json()["error"]["type"] == "service_unavailable"
    with client.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "model_unavailable"
    records = [r for r in caplog.records if r.name.startswith("k3ray")]
    assert not any(r.exc_info for r in records), "a traceback was logged"
    assert [r.getMessage() for r in records] == [
        "requests answered 503: StageFailure: model step failed: an actor of the pipeline died (ActorUnavailableError)"]


def test_repeat_log_counts_a_repeated_failure_and_logs_a_new_one(caplog):
    caplog.set_level(logging.INFO)
    log = RepeatLog(logging.getLogger("k3ray.test"), every_s=3600)
    for _ in range(5):
        log.failure("stage 1 lost")
    log.failure("shard 0 lost")
    log.ended("recovered")
    assert [r.getMessage() for r in caplog.records] == [
        "stage 1 lost", "repeated 4 more times in 0 s: stage 1 lost", "shard 0 lost", "recovered"]
