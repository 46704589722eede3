"""Schema fuzz of the request bodies: bodies drawn from each route's JSON schema (pydantic's, the one
the app publishes in its OpenAPI document), the same with arbitrary JSON spliced into fields, and raw
bytes, sent to the app in-process with the real engine and tiny model. None may answer 5xx;
every 4xx carries an OpenAI error body and every stream ends with [DONE] and no server error."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3ray.actors.openai.protocol import (
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from k3ray.actors.openai.routes import build_openai_app
from k3ray.actors.openai.serving import OpenAIServing
from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import build_engine
from k3ray.actors.serve.metrics import ServeMetrics
from k3ray.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-fuzz"
ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    args = ServeArgs.model_validate({
        "model": {"model": tiny_checkpoint}, "server": {"served_model_name": MODEL, "max_body_bytes": 64 * 1024},
        "engine": {"max_model_len": 160, "cache_memory_mb": 16, "max_num_seqs": 8}}).resolved()
    engine, _ = build_engine(args)
    async_engine = AsyncEngine(engine)
    metrics = ServeMetrics(MODEL, async_engine.get_stats)
    app = build_openai_app(OpenAIServing(async_engine, engine.tokenizer, MODEL, metrics), metrics=metrics,
                           max_body_bytes=args.server.max_body_bytes)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
        assert c.get("/metrics").status_code == 200


def from_schema(schema: dict, defs: dict, overrides: dict | None = None) -> st.SearchStrategy:
    """Values valid for the subset of JSON Schema pydantic emits (types, bounds, anyOf, $ref);
    `overrides` mixes more useful values into top-level properties."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema["enum"] if "enum" in schema else [schema["const"]])
    kind = schema.get("type")
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "string":
        return st.text(max_size=24)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), max_size=4)
    if kind == "object" and schema.get("properties"):
        props = {k: from_schema(v, defs) for k, v in schema["properties"].items()}
        for k, extra in (overrides or {}).items():
            if k in props:
                props[k] = st.one_of(extra, props[k])
        required = [k for k in schema.get("required", []) if k in props]
        optional = {k: v for k, v in props.items() if k not in required}
        return st.fixed_dictionaries({k: props[k] for k in required}, optional=optional)
    return json_values


token_ids = st.lists(st.integers(0, 511), min_size=1, max_size=16)
parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=12)}), max_size=2)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.text(max_size=16) | parts})
NEUTRAL = st.sampled_from([None, 0.0])
# the values a working client sends, so that many fuzzed requests reach the engine
OVERRIDES = {
    "model": st.sampled_from([MODEL, None]), "prompt": st.text(min_size=1, max_size=24) | token_ids
    | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3) | st.lists(token_ids, min_size=1, max_size=3),
    "messages": st.lists(message, min_size=1, max_size=3), "tokens": token_ids,
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(0, MAX_SEED), "logprobs": st.integers(0, 5),
    "top_logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 3),
    "stop_token_ids": st.lists(st.integers(0, 511)),
    "presence_penalty": NEUTRAL, "frequency_penalty": NEUTRAL, "repetition_penalty": st.sampled_from([None, 1.0]),
    "logit_bias": st.none(), "best_of": st.none(), "suffix": st.none(), "tools": st.none(), "tool_choice": st.none(),
    "response_format": st.none(), "continue_final_message": st.just(False),
}


def bodies(model) -> st.SearchStrategy:
    """Schema-valid bodies, kept cheap (few tokens, few samples), then some fields made arbitrary."""
    schema = model.model_json_schema()
    props = schema["properties"]
    for name, bound in (("max_tokens", 8), ("max_completion_tokens", 8), ("n", 3)):
        if name in props:
            props[name] = {"anyOf": [{"type": "integer", "minimum": -2, "maximum": bound}, {"type": "null"}]}
    valid = from_schema(schema, schema.get("$defs", {}), OVERRIDES)
    fields = sorted(props)

    @st.composite
    def mutated(draw):
        body = dict(draw(valid))
        for name in draw(st.lists(st.sampled_from(fields), max_size=2, unique=True)):
            body[name] = draw(json_values)
        return body

    return st.one_of(valid, valid, mutated())


def check(resp, body) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], body)
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, resp.text
    elif isinstance(body, dict) and body.get("stream") is True:
        events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", resp.text[-300:]
        assert not any('"internal_error"' in e for e in events), resp.text[-500:]
    else:
        resp.json()


def post(client, route, body):
    data = json.dumps(body, allow_nan=True).encode() if not isinstance(body, bytes) else body
    return client.post(route, content=data, headers={"content-type": "application/json"})


@pytest.mark.parametrize("route", sorted(ROUTES))
@FUZZ
@given(data=st.data())
def test_schema_bodies_never_fail_the_server(client, route, data):
    body = data.draw(bodies(ROUTES[route]), label="body")
    check(post(client, route, body), body)


@FUZZ
@given(route=st.sampled_from(sorted(ROUTES)), body=json_values | st.binary(max_size=64))
def test_arbitrary_bodies_are_client_errors(client, route, body):
    resp = post(client, route, body)
    check(resp, body)
    if not isinstance(body, (dict, bytes)):  # JSON that is not an object
        assert resp.status_code == 400


def test_openapi_documents_every_route(client):
    paths = client.get("/openapi.json").json()["paths"]
    for route in [*ROUTES, "/v1/models", "/tokenizer_info", "/health", "/metrics"]:
        assert route in paths
