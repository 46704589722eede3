"""Safe failure of the live Serve app: every bad request is a 4xx with an OpenAI error body (never
a 5xx), an API key gates the routes, overload answers 429 with Retry-After, and a client that
disconnects (streaming or not) cancels its generation and frees its cache."""

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-strict"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256
MAX_BODY = 4096
LONG = 240  # tokens: several seconds of decoding, so a disconnect lands mid-generation



@pytest.fixture(scope="module")
def server(serve_app, tiny_checkpoint):
    return serve_app(
        {"model": {"model": tiny_checkpoint},
         "server": {"served_model_name": MODEL, "api_key": KEY, "max_body_bytes": MAX_BODY,
                    "max_ongoing_requests": 1, "max_queued_requests": 1, "retry_after_s": 2},
         "engine": {"max_model_len": MAX_MODEL_LEN, "cache_memory_mb": 16, "max_num_seqs": 4}}
    )


@pytest.fixture(scope="module")
def queue_server(server, serve_app, tiny_checkpoint):
    """A second app on the same Serve: room for 8 requests per replica, but an engine that runs one
    sequence at a time and a queue of at most 16 prompt tokens."""
    from ray import serve

    url = serve_app(
        {"model": {"model": tiny_checkpoint},
         "server": {"served_model_name": MODEL, "api_key": KEY, "max_ongoing_requests": 8, "max_queued_tokens": 16,
                    "retry_after_s": 2},
         "engine": {"max_model_len": MAX_MODEL_LEN, "cache_memory_mb": 16, "max_num_seqs": 1}},
        port=int(server.rsplit(":", 1)[1]), name="k3ray-queue", route_prefix="/queue")
    yield url
    serve.delete("k3ray-queue")


@pytest.fixture(scope="module")
def long_server(server, serve_app, tiny_checkpoint):
    """A third app: the engine's default long-context settings on an 80 MB cache (about 240K tokens)."""
    from ray import serve

    url = serve_app(
        {"model": {"model": tiny_checkpoint},
         "server": {"served_model_name": MODEL, "api_key": KEY, "retry_after_s": 2},
         "engine": {"cache_memory_mb": 80}},
        port=int(server.rsplit(":", 1)[1]), name="k3ray-long", route_prefix="/long")
    yield url
    serve.delete("k3ray-long")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def metrics(http) -> dict[str, float]:
    """Samples of /metrics keyed by name plus any labels besides model_name."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_api_key(server, http):
    assert error_of(httpx.get(f"{server}/v1/models"), 401)["code"] == "invalid_api_key"
    error_of(httpx.post(f"{server}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"}), 401)
    error_of(httpx.post(f"{server}/tokenize", json={"prompt": "x"}), 401)
    assert httpx.get(f"{server}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{server}/metrics").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200  # any case
    error_of(httpx.get(f"{server}/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()


def test_malformed_bodies_are_400(http):
    for body in (b"{not json", b"[]", b"", b'"text"', b"\xff\xfe", b'{"prompt": "x"'):
        error_of(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    error_of(http.post("/v1/chat/completions", content=b"messages=1",
                       headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    assert error_of(http.post("/v1/completions", json={"max_tokens": 3}), 400)["param"] == "prompt"


def test_unknown_model_route_and_method(server, http):
    body = error_of(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
    assert body["param"] == "model" and body["code"] == "model_not_found"
    error_of(http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
             404)
    error_of(http.get("/v1/models/gpt-4"), 404)
    error_of(http.get("/v1/nothing"), 404)
    error_of(http.get("/v1/completions"), 405)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0).completions.create(model="x", prompt="y")


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"n": 0}, "n"), ({"n": 10**9}, "n"), ({"logprobs": 21}, "logprobs"), ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"), ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"), ({"seed": 2**80}, "seed"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": [[1], []]}, "prompt"), ({"prompt": {"text": "x"}}, "prompt"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"1": 200}}, "logit_bias"), ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"n": 2, "best_of": 1}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"temperature": float("nan")}, "temperature"),
    # strict types: no bool or string coerced to a number
    ({"max_tokens": "3"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"prompt": [True, 1]}, "prompt"),
    ({"n": True}, "n"), ({"temperature": "0.5"}, "temperature"), ({"seed": False}, "seed"),
])
def test_bad_completion_parameters(http, fields, param):
    body = json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()  # NaN is sent as the literal NaN
    assert error_of(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}),
                    400)["param"] == param


@pytest.mark.parametrize("fields", [{"prompt": "x" * 300}, {"prompt": "hi", "max_tokens": 10**6},
                                    {"prompt": list(range(1, 200)), "max_tokens": 100}])
def test_context_limit(http, fields):
    body = error_of(http.post("/v1/completions", json={"model": MODEL, **fields}), 400)
    assert body["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in body["message"]


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                 {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": "hello"}, "messages"),
])
def test_bad_chat_requests(http, fields, param):
    body = error_of(http.post("/v1/chat/completions", json={"model": MODEL, **fields}), 400)
    assert body["param"] == param
    if param.endswith("content[1]"):
        assert "image_url" in body["message"] and "not supported" in body["message"]


def test_openapi_states_every_answer(http):
    doc = http.get("/openapi.json").json()
    for path, operations in doc["paths"].items():
        # Anthropic's Messages API answers its errors in Anthropic's shape
        body = "AnthropicErrorBody" if path.startswith("/v1/messages") else "ErrorBody"
        error_schema = {"$ref": f"#/components/schemas/{body}"}
        for operation in operations.values():
            answers = operation["responses"]
            assert "422" not in answers, path  # a failed validation answers 400
            for status in ("400", "404", "413", "429", "503"):
                assert answers[status]["content"]["application/json"]["schema"] == error_schema, (path, status)
            # the key guards every route but the probes and /metrics (this server has one)
            assert ("401" in answers) == (path not in ("/health", "/ready", "/metrics")), path
    assert set(doc["paths"]["/health"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    (metrics_type,) = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert metrics_type.startswith("text/plain") and http.get("/metrics").headers["content-type"] == metrics_type
    assert http.get("/health").headers["content-type"].startswith("text/plain")


def test_tokenizer_routes_reject_bad_input(http):
    error_of(http.post("/tokenize", json={}), 400)
    error_of(http.post("/detokenize", json={"tokens": [True]}), 400)
    error_of(http.post("/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "x"}]}), 400)
    error_of(http.post("/detokenize", json={"tokens": [10**6]}), 400)
    error_of(http.post("/detokenize", json={"tokens": "abc"}), 400)
    error_of(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)


def test_oversized_body_is_413(http):
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    assert error_of(http.post("/v1/completions", json=big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    error_of(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def hold_a_stream(server: str):
    """A streaming request that runs for several seconds; returns (response, client, its line
    iterator) after its first chunk arrived, i.e. once it holds the replica. Keep the iterator: one
    dropped mid-stream closes the response (httpcore closes the connection on GeneratorExit)."""
    client = httpx.Client(base_url=server, headers=AUTH, timeout=120)
    req = client.build_request("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "a", "max_tokens": LONG, "ignore_eos": True, "temperature": 0, "stream": True})
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    next(lines)
    return resp, client, lines


def test_overload_answers_429_with_retry_after(server, http):
    resp, client, _lines = hold_a_stream(server)  # max_ongoing_requests=1: the replica is busy
    results: list[httpx.Response] = []

    def call():
        results.append(httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=120,
                                  json={"model": MODEL, "prompt": "b", "max_tokens": 2}))

    threads = [threading.Thread(target=call) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        # max_queued_requests=1: one request may wait, the others are turned away at once
        while sum(r.status_code == 429 for r in results) < 3 and len(results) < len(threads):
            assert time.monotonic() < deadline, [r.status_code for r in results]
            time.sleep(0.1)
    finally:
        resp.close()
        client.close()
        for t in threads:
            t.join(timeout=120)
    statuses = [r.status_code for r in results]
    assert len(statuses) == 6 and set(statuses) <= {200, 429} and statuses.count(429) >= 3, statuses
    assert all(r.headers["retry-after"] == "2" for r in results if r.status_code == 429)


def test_a_queue_full_of_prompt_tokens_answers_429_at_once(queue_server):
    """One stream holds the engine's only sequence; of two 10-token requests behind it, the first
    waits in the replica's queue and the second would take it past 16 tokens: a 429 while the stream
    still runs (the engine has finished nothing since), whose Retry-After is the configured 2 s or
    the queue's expected wait if longer (3 s seen on a loaded machine), the same figure its message
    gives."""
    resp, client, _lines = hold_a_stream(queue_server)
    finished_before = finished_requests(queue_server)
    results: dict[int, httpx.Response] = {}

    def call(i: int) -> None:
        results[i] = httpx.post(f"{queue_server}/v1/completions", headers=AUTH, timeout=120,
                                json={"model": MODEL, "prompt": "x" * 10, "max_tokens": 2})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not results:
            assert time.monotonic() < deadline, "neither request was answered while the stream ran"
            time.sleep(0.05)
        (refused,) = results.values()
        assert finished_requests(queue_server) == finished_before, "the 429 waited for the stream to end"
        error, retry = error_of(refused, 429), refused.headers["retry-after"]
        assert error["code"] == "queue_full" and 2 <= int(retry) <= 60, retry
        assert f"retry after {retry} s" in error["message"], error
    finally:
        resp.close()
        client.close()
        for t in threads:
            t.join(timeout=120)
    assert sorted(r.status_code for r in results.values()) == [200, 429]


def finished_requests(url: str) -> float:
    """Requests the app's engine has finished, for whatever reason (its /metrics)."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as probe:
        return sum(v for k, v in metrics(probe).items() if k.startswith("k3ray:request_success_total"))


ABORTED = 'k3ray:request_success_total{finished_reason="abort"}'


def wait_for_idle(http, aborted_before: float) -> dict:
    """Poll /metrics until nothing runs, no cache is held and one more request was aborted."""
    deadline = time.monotonic() + 60
    while True:
        m = metrics(http)
        freed = m["k3ray:num_requests_running"] == 0 and m["k3ray:state_slots_live"] == 0
        if freed and m["k3ray:mla_blocks_used"] == 0 and m.get(ABORTED, 0) > aborted_before:
            return m
        assert time.monotonic() < deadline, {k: m.get(k) for k in (
            "k3ray:num_requests_running", "k3ray:num_requests_waiting", "k3ray:state_slots_live",
            "k3ray:mla_blocks_used", ABORTED)} | {"aborted_before": aborted_before}
        time.sleep(0.2)


def test_disconnect_cancels_a_stream(server, http):
    before = metrics(http).get(ABORTED, 0)
    resp, client, _lines = hold_a_stream(server)
    resp.close()
    client.close()
    m = wait_for_idle(http, before)
    assert m[ABORTED] == before + 1


def test_disconnect_cancels_a_plain_request(server, http):
    """The client leaves once its plain request is generating (seen in /metrics), not after a fixed
    read timeout: once decoding got faster, 240 tokens could finish inside the timeout's window."""
    import socket
    from urllib.parse import urlsplit

    before = metrics(http).get(ABORTED, 0)
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": LONG, "ignore_eos": True}).encode()
    url = urlsplit(server)
    head = (f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    client = socket.create_connection((url.hostname, url.port), timeout=30)
    client.sendall(head + body)
    deadline = time.monotonic() + 60
    while metrics(http)["k3ray:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.02)
    client.setblocking(False)
    with pytest.raises(BlockingIOError):  # no answer yet: the client leaves mid-generation
        client.recv(1)
    client.close()
    m = wait_for_idle(http, before)
    assert m[ABORTED] == before + 1


def test_a_dead_engine_process_fails_health_then_serve_replaces_the_replica(server, http, k3server_replicas):
    """The replica's engine process dies: /health turns 503 naming it, Serve's health check
    replaces the replica (with a new engine process), and requests succeed again. Last in the
    module: it restarts the server."""
    import psutil

    def engine_processes() -> list[psutil.Process]:
        return [child for replica in k3server_replicas() for child in replica.children()
                if "k3ray.engine.process.engine_core_proc" in " ".join(child.cmdline())]

    (victim,) = engine_processes()
    victim.kill()
    deadline = time.monotonic() + 30
    while (resp := httpx.get(f"{server}/health", timeout=30)).status_code == 200:
        assert time.monotonic() < deadline, "the dead engine process never showed in /health"
        time.sleep(0.2)
    # the app names the dead engine; HAProxy, which answers /health from its checks, says retry
    assert error_of(resp, 503)["code"] in ("model_unavailable", "starting") and resp.headers["retry-after"]
    if error_of(resp, 503)["code"] == "model_unavailable":
        assert "engine process" in error_of(resp, 503)["message"]
    # a request meanwhile: a 503 that says retry, with an OpenAI body (the app's, or HAProxy's page once
    # the replica is out), never a 500
    dead = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=60, json={"model": MODEL, "prompt": "x"})
    assert error_of(dead, 503)["type"] == "service_unavailable" and int(dead.headers["retry-after"]) >= 1
    deadline = time.monotonic() + 240
    while True:
        try:
            ok = httpx.get(f"{server}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and [p.pid for p in engine_processes()] not in ([], [victim.pid]):
            break
        assert time.monotonic() < deadline, "Serve did not replace the replica"
        time.sleep(1)
    out = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def first_token(url: str, prompt: str) -> tuple[int, bool]:
    """(status, whether streamed text came) of a short completion, read up to its first text."""
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}) as resp:
        if resp.status_code != 200:
            return resp.status_code, False
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"] is not None:
                return 200, True
    return 200, False


def test_short_requests_run_beside_a_200k_token_prompt(long_server):
    """A 200K-token prompt takes minutes to prefill here. Short requests sent meanwhile are admitted
    and get their first token while it still prefills (before: every one got 429 for the long
    prompt's tokens); a second long prompt is the only one told to wait, by a 429 naming the long
    lane."""
    import socket
    from urllib.parse import urlsplit

    body = json.dumps({"model": MODEL, "prompt": "The haystack. " * 14_286, "max_tokens": 4}).encode()  # 200,004 tokens
    url = urlsplit(long_server)
    head = (f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    client = socket.create_connection((url.hostname, url.port), timeout=30)
    try:
        client.sendall(head + body)
        deadline = time.monotonic() + 120
        while long_prefill_rate(long_server) == 0:
            assert time.monotonic() < deadline, "the long prompt never started prefilling"
            time.sleep(0.5)
        firsts: list[tuple[int, bool]] = []
        shorts = [threading.Thread(target=lambda i=i: firsts.append(first_token(long_server, f"Short {i}: hello")))
                  for i in range(4)]
        for t in shorts:
            t.start()
        for t in shorts:
            t.join(timeout=150)
        assert firsts == [(200, True)] * 4, firsts
        second = httpx.post(f"{long_server}/v1/completions", headers=AUTH, timeout=60,
                            json={"model": MODEL, "prompt": "y" * 50_000, "max_tokens": 4})
        error = error_of(second, 429)
        assert "long prompts (over 16384 tokens) are ahead in their own lane" in error["message"], error
        assert int(second.headers["retry-after"]) > 2
        client.setblocking(False)
        with pytest.raises(BlockingIOError):  # no answer yet: it still prefills, so the shorts came beside it
            client.recv(1)
    finally:
        client.close()  # the long request is aborted with its connection
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=long_server, headers=AUTH, timeout=30) as probe:
        while (m := metrics(probe))["k3ray:num_requests_running"] or m["k3ray:long_prefill_backlog_tokens"]:
            assert time.monotonic() < deadline, m
            time.sleep(0.5)


def long_prefill_rate(url: str) -> float:
    """The app's measured long-prompt prefill rate (0 while none ran, or while HAProxy still
    brings its metrics listener in)."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as probe:
        try:
            return metrics(probe).get("k3ray:long_prefill_tokens_per_second", 0.0)
        except ValueError:
            return 0.0
