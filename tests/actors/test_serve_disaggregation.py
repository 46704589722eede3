"""Prefill/decode disaggregation on a real Serve app on loopback (one K3Prefill and one K3Server decode
replica, each an engine process): through the real openai client, greedy outputs equal the
colocated engine's token for token — plain prompts, chunked prefill (64-token steps, each chunk's
latent rows sent while the next runs), n-gram
speculative decoding on the decode side, a prefix the decode replica already holds (only the rest
travels), streaming, structured output through chat, n > 1 (run whole on the decode replica), and
both pools as pipeline 2 x expert-parallel 2 replicas, whose stages hand their parts over Ray's NIXL
tensor transport (the object-store path between stages is tied in tests/actors/test_ray_handoff.py)."""

import json
import time

import pytest
from openai import APIConnectionError, APIStatusError, OpenAI
from ray import serve

from k3ray.actors.serve.driver_calls import call_deployment
from k3ray.actors.serve.ingress_routing import prompt_ids
from k3ray.engine.llm import LLM
from k3ray.sampling_params import SamplingParams, StructuredOutputsParams
from k3ray.tokenizer import load_tokenizer

BS = 16
ENGINE = {"max_num_seqs": 4, "block_size": BS, "max_num_batched_tokens": 64, "speculative_ngram": 3}
APP = "k3ray-pd"
APP_PP = "k3ray-pd-pipelines"


@pytest.fixture(scope="module")
def pd_app(serve_app, k2_tiny_checkpoint):
    args = {"model": {"model": k2_tiny_checkpoint}, "server": {"served_model_name": "k3-tiny"}, "engine": ENGINE,
            "disaggregation": {"prefill_replicas": 1}}
    url = serve_app(args, name=APP)
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    wait_serving(client)
    return client


def wait_serving(client: OpenAI, timeout_s: float = 300) -> None:
    """Until a request goes through (the decode replica and a prefill replica are up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.completions.create(model="k3-tiny", prompt=[1, 2, 3], max_tokens=1)
            return
        except (APIConnectionError, APIStatusError) as e:  # not serving yet
            assert not isinstance(e, APIStatusError) or e.status_code >= 500, e
            assert time.monotonic() < deadline, "the disaggregated app did not start serving"
            time.sleep(2)


@pytest.fixture(scope="module")
def colocated(k2_tiny_checkpoint):
    return LLM(k2_tiny_checkpoint, max_num_seqs=4, block_size=BS)


def handoff_stats() -> dict:
    return call_deployment(APP, "K3Server", "handoff_stats")


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 200 + 30 for i in range(n)]


def reference(llm, prompt, max_tokens=12, **kw) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return llm.generate([prompt], params)[0].outputs[0].text


def test_greedy_completions_equal_the_colocated_engine(pd_app, colocated):
    before = handoff_stats()
    repeating = ids(20, 1) * 4  # n-gram drafts get accepted on the decode side
    for prompt in (ids(5, 2), ids(70, 3), repeating, ids(150, 4)):  # under a block .. several 64-token chunks
        out = pd_app.completions.create(model="k3-tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == reference(colocated, prompt), prompt[:8]
    after = handoff_stats()
    assert after["handoffs"] - before["handoffs"] == 4
    assert after["transports"]["host"] - before["transports"].get("host", 0) == 4
    # the rows of each 64-token chunk but the last went while the next ran: at least one part for each of
    # the 70- and 80-token prompts, two for the 150-token one; the 5-token prompt's rows all went at the end
    parts, early, latent = (after[k] - before[k] for k in ("parts", "part_bytes", "latent_bytes"))
    assert parts >= 4 and 0 < early < latent


def test_a_prefix_the_decode_replica_holds_is_not_sent_again(pd_app, colocated):
    shared = ids(160, 5)
    first, second = shared + ids(9, 6), shared + ids(11, 7)
    pd_app.completions.create(model="k3-tiny", prompt=first, max_tokens=4, temperature=0)
    before = handoff_stats()
    out = pd_app.completions.create(model="k3-tiny", prompt=second, max_tokens=12, temperature=0)
    assert out.choices[0].text == reference(colocated, second)
    after = handoff_stats()
    sent = after["tokens_sent"] - before["tokens_sent"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(second)
    assert sent == len(second) - 160, sent  # the ten shared blocks stayed on the decode side


def test_streaming_equals_the_whole_response(pd_app, colocated):
    prompt = ids(90, 8)
    stream = pd_app.completions.create(model="k3-tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == reference(colocated, prompt, max_tokens=16)


def test_structured_output_through_chat(pd_app, colocated, k2_tiny_checkpoint):
    schema = {"type": "object", "properties": {"code": {"type": "integer"}}, "required": ["code"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Give the code as JSON."}]
    out = pd_app.chat.completions.create(
        model="k3-tiny", messages=messages, max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "code", "schema": schema}})
    text = out.choices[0].message.content
    prompt = prompt_ids(load_tokenizer(k2_tiny_checkpoint), {"messages": messages})
    want = reference(colocated, prompt, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))
    assert text == want
    if out.choices[0].finish_reason == "stop":
        assert set(json.loads(text)) == {"code"}


def test_several_samples_run_on_the_decode_replica(pd_app):
    before = handoff_stats()
    out = pd_app.completions.create(model="k3-tiny", prompt=ids(30, 9), max_tokens=6, temperature=1.0, n=2, seed=3)
    assert len(out.choices) == 2
    assert handoff_stats()["handoffs"] == before["handoffs"]


@pytest.fixture(scope="module")
def pd_pipelines(serve_app, k2_tiny_checkpoint, pd_app):
    """Both pools as pipeline 2 x expert-parallel 2 replicas (each stage exports and imports its own
    layers' part of the handoff); the single-process app goes first, to leave its CPUs to these actors."""
    serve.delete(APP)
    parallel = {"pipeline": 2, "expert_parallel": 2, "replica_cpus": 0.25, "stage_cpus": 0.25, "shard_cpus": 0.25,
                "router_cpus": 0.125, "vision_cpus": 0.125, "handoff_transport": "nixl"}
    args = {"model": {"model": k2_tiny_checkpoint}, "server": {"served_model_name": "k3-tiny"}, "engine": ENGINE,
            "parallel": parallel, "disaggregation": {"prefill_replicas": 1}}
    url = serve_app(args, name=APP_PP, port=pd_app.base_url.port)  # Serve's HTTP port is set once
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    wait_serving(client)
    return client


def test_pipeline_and_expert_parallel_on_both_sides(pd_pipelines, colocated):
    before = call_deployment(APP_PP, "K3Server", "handoff_stats")
    shared = ids(64, 10)
    for prompt in (ids(40, 11), shared + ids(20, 12), shared + ids(7, 13)):
        out = pd_pipelines.completions.create(model="k3-tiny", prompt=prompt, max_tokens=10, temperature=0)
        assert out.choices[0].text == reference(colocated, prompt, max_tokens=10), prompt[:8]
    after = call_deployment(APP_PP, "K3Server", "handoff_stats")
    assert after["handoffs"] - before["handoffs"] == 3
    assert after["transports"]["stage-direct-nixl"] - before["transports"].get("stage-direct-nixl", 0) == 3
    assert after["parts"] == before["parts"]  # a pipeline's rows stay at its stages until the prefill ends
    sent, prompts = (after[k] - before[k] for k in ("tokens_sent", "prompt_tokens"))
    assert sent == prompts - 64  # the last prompt's shared blocks stayed on the decode side
