"""The live Serve app on loopback, driven by the official `openai` client; greedy outputs and
echoed prompt logprobs are checked against the tiny K3 run directly (`K3`, no engine, no server).
The chat route's output is plain text here: the checkpoint speaks Kimi K2's format (K3's XTML, whose
output is read as channels: test_serve_xtml.py)."""

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from k3ray.actors.openai.logprobs import token_text
from k3ray.api import K3

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-test"
MAX_MODEL_LEN = 512
# fp32 on both sides; the server batches and chunks prefill differently, so sums of up to ~40
# log-probs may differ in the last bits
LOGPROB_ATOL = 1e-3
GRAMMAR_COMPILE_TIMEOUT_S = 10  # a grammar that takes longer to compile answers 400



@pytest.fixture(scope="module")
def server(serve_app, k2_tiny_checkpoint):
    return serve_app(
        {"model": {"model": k2_tiny_checkpoint}, "server": {"served_model_name": MODEL},
         "engine": {"max_model_len": MAX_MODEL_LEN, "cache_memory_mb": 16, "max_num_seqs": 8,
                    "grammar_compile_timeout_s": GRAMMAR_COMPILE_TIMEOUT_S}}
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def k3(k2_tiny_checkpoint):
    return K3.load(k2_tiny_checkpoint)


def greedy_ids(k3: K3, prompt_ids: list[int], n: int) -> list[int]:
    """The engine stops at EOS and at <|im_end|> (the tokenizer's end of turn); K3 only at EOS."""
    return k3.generate(prompt_ids, max_new_tokens=n, stop_token_ids=sorted(k3.tokenizer.stop_token_ids))


def expected_text(k3: K3, ids: list[int]) -> str:
    return k3.tokenizer.decode(ids, skip_special_tokens=True)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_matches_model(client, k3):
    prompt = "The Ray cluster"
    ids = greedy_ids(k3, k3.tokenizer.encode(prompt), 12)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected_text(k3, ids)
    assert r.usage.prompt_tokens == len(prompt.encode()) and r.usage.completion_tokens == len(ids)


def test_token_id_prompts_and_batches_equal_single_requests(client, k3):
    prompts = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7], [200, 100]]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for p, choice in zip(prompts, batch.choices):
        assert choice.text == expected_text(k3, greedy_ids(k3, p, 6))
        single = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        assert single.choices[0].text == choice.text
    texts = client.completions.create(model=MODEL, prompt=["Hi", "Ray"], max_tokens=4, temperature=0)
    assert [c.text for c in texts.choices] == [expected_text(k3, greedy_ids(k3, k3.tokenizer.encode(t), 4))
                                               for t in ("Hi", "Ray")]


def test_n_samples_are_seeded_and_indexed(client):
    kw = dict(model=MODEL, prompt=["a", "b"], max_tokens=8, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices[:3]}) > 1  # 3 samples at temperature 1 differ
    assert first.usage.completion_tokens == 2 * 3 * 8  # ignore_eos: every sample runs to max_tokens


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=24, temperature=0).choices[0].text
    stop = next((c for c in full[1:] if c.isascii() and c.isprintable()), None)
    assert stop is not None, f"pick another prompt: no printable ASCII in {full!r}"
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=24, temperature=0, stop=[stop],
                                      stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full[: full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_logprobs_as_lm_eval_reads_them(client, k3):
    context, continuation = k3.tokenizer.encode("The capital of"), k3.tokenizer.encode(" Ray")
    ids = context + continuation
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=1, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith("The capital of Ray")
    assert lp.text_offset[: len(ids)] == list(range(len(ids)))  # one byte-level token per ASCII char
    # lm-eval: sum(token_logprobs[ctxlen:-1]), greedy iff every token is its position's top logprob
    logprob = sum(lp.token_logprobs[len(context):-1])
    greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[len(context):-1],
                                                         lp.top_logprobs[len(context):-1]))
    ref_logprob, ref_greedy = k3.loglikelihood(context, continuation)
    assert logprob == pytest.approx(ref_logprob, abs=LOGPROB_ATOL) and greedy == ref_greedy
    # every prompt position: its logprob under the model
    ref = torch.log_softmax(k3.logits(ids), -1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(want, abs=LOGPROB_ATOL)
    # max_tokens=0: the prompt alone
    r0 = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    assert len(r0.choices[0].logprobs.tokens) == len(ids) and r0.usage.completion_tokens == 0
    assert r0.choices[0].text == "The capital of Ray"


def test_logprob_tokens_are_text(client, k3):
    """OpenAI's rule (vLLM's too): a token's text, `bytes:\\xNN` for part of a UTF-8 character, a
    special token's name; text_offset indexes the choice's text."""
    tok = k3.tokenizer
    ids = [*"né".encode(), tok.eos_token_id, 300]  # 300: a reserved slot
    r = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=3, logprobs=5, temperature=0)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert lp.tokens[:5] == ["n", "bytes:\\xc3", "bytes:\\xa9", "[EOS]", "<|reserved_token_300|>"]
    assert choice.text.startswith("né[EOS]<|reserved_token_300|>") and lp.text_offset[:5] == [0, 1, 1, 2, 7]
    names = {token_text(tok, i) for i in range(tok.vocab_size)}
    assert all(set(top) <= names and len(top) >= 5 for top in lp.top_logprobs[1:])
    for token, offset, next_offset in zip(lp.tokens[5:], lp.text_offset[5:], [*lp.text_offset[6:], len(choice.text)]):
        assert token in names and 0 <= next_offset - offset <= max(len(token), 1)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "é"}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    for item in [*content, *(top for item in content for top in item.top_logprobs)]:
        (token_id,) = [i for i in range(tok.vocab_size) if token_text(tok, i) == item.token]
        piece = tok.token_piece(token_id)
        assert item.bytes == list(piece if isinstance(piece, bytes) else piece.encode())


def test_top_logprobs_zero_and_max_tokens_zero_are_served(client):
    """What the OpenAPI document allows is served: top_logprobs 0 without logprobs (as vLLM and OpenAI
    take it), max_tokens 0 without echo (OpenAI's minimum is 0: nothing is generated)."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          logprobs=False, top_logprobs=0)
    assert chat.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       top_logprobs=1)
    assert e.value.body["param"] == "top_logprobs"
    empty = client.completions.create(model=MODEL, prompt=["Hi", "there"], max_tokens=0, logprobs=1)
    assert [c.text for c in empty.choices] == ["", ""] and empty.usage.completion_tokens == 0
    assert {c.finish_reason for c in empty.choices} == {"length"} and empty.choices[0].logprobs.tokens == []


def test_generated_logprobs_are_top_ranked_when_greedy(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value == max(top.values())
    assert lp.text_offset == sorted(lp.text_offset)


def test_streaming_completion_equals_non_streaming(client, server):
    kw = dict(model=MODEL, prompt=["Hello", "World"], max_tokens=10, temperature=0)
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    for choice in plain.choices:
        streamed = "".join(c.text for ch in chunks for c in ch.choices if c.index == choice.index)
        assert streamed == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens
    with httpx.stream("POST", f"{server}/v1/completions", json={**kw, "stream": True}, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_chat_matches_model_and_streams(client, k3):
    messages = [{"role": "user", "content": "Say hi"}]
    ids = greedy_ids(k3, k3.tokenizer.encode_chat(messages), 10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == expected_text(k3, ids)
    assert r.usage.prompt_tokens == len(k3.tokenizer.encode_chat(messages)) and r.usage.completion_tokens == len(ids)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy: the top-1 token
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_chat_continues_a_trailing_assistant_message(client, k3):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1 2 3"}]
    prompt = k3.tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.content == expected_text(k3, greedy_ids(k3, prompt, 5))


def test_n_chat_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       n=2, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1]


def test_tokenizer_routes(server, k3):
    info = httpx.get(f"{server}/tokenizer_info").json()
    assert info["eos_token"] == "[EOS]" and info["model_max_length"] == MAX_MODEL_LEN
    tok = httpx.post(f"{server}/tokenize", json={"prompt": "[EOS]hi", "add_special_tokens": False}).json()
    assert tok == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": [257, 104, 105], "token_strs": None}
    messages = [{"role": "user", "content": "hey"}]
    chat = httpx.post(f"{server}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == k3.tokenizer.encode_chat(messages)
    assert httpx.post(f"{server}/detokenize", json={"tokens": [104, 105, 257]}).json() == {"prompt": "hi[EOS]"}


def test_health_and_metrics(client, server):
    assert httpx.get(f"{server}/health").status_code == 200
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(f"{server}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    label = f'{{model_name="{MODEL}"}}'
    assert values[f"k3ray:time_to_first_token_seconds_count{label}"] >= 1
    assert values[f"k3ray:e2e_request_latency_seconds_count{label}"] >= 1
    assert values[f"k3ray:time_per_output_token_seconds_count{label}"] >= 1
    assert values[f"k3ray:generation_tokens_total{label}"] >= 3
    assert values[f"k3ray:num_requests_running{label}"] == 0
    for name in ("cache_usage_perc", "prefix_cache_hit_rate", "num_requests_waiting", "spec_decode_acceptance_rate"):
        assert f"k3ray:{name}{label}" in values
    assert json.loads(httpx.get(f"{server}/v1/models/{MODEL}").text)["id"] == MODEL


PROBE_STREAMS = 200  # 8 run (max_num_seqs), 192 wait in the replica's queue


def test_health_ready_and_metrics_answer_outside_the_queue_while_200_streams_run(server):
    """HAProxy answers /health and /ready itself and sends /metrics to the replica's metrics listener,
    all outside the replica's request queue: while streams fill the replica and its queue, each probe
    is answered by HAProxy or the listener (under 300 streams they queued for 23 s before). Then the
    clients leave, and their generations are cancelled: the engine goes idle having generated fewer
    tokens than the streams asked for. Probed by curl, outside the test's own event loop."""
    import asyncio
    import subprocess

    def probe(path: str) -> tuple[int, str]:
        """(status, who answered: "ingress" for HAProxy itself, "listener" for the replica's metrics
        listener, which is Python's http.server, "replica" otherwise)."""
        fmt = "%{http_code}|%header{x-k3ray-answered-by}|%header{server}"
        status, by, software = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", fmt, f"{server}{path}"],
                                              capture_output=True, text=True, timeout=30).stdout.split("|")
        return int(status), by or ("listener" if software.startswith("BaseHTTP/") else "replica")

    def haproxy_pids() -> set[int]:
        """This server's HAProxy processes (their config lies in its runtime folder): a reload shows."""
        runtime = os.environ["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
        found = subprocess.run(["pgrep", "-f", f"haproxy .*{runtime}"], capture_output=True, text=True).stdout
        return {int(pid) for pid in found.split()}

    async def stream(http: httpx.AsyncClient) -> None:
        body = {"prompt": "load", "max_tokens": 128, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                pass

    async def under_load() -> list[tuple]:
        """(path, status, who answered, streams still open when it answered) per probe."""
        limits = httpx.Limits(max_connections=PROBE_STREAMS)
        async with httpx.AsyncClient(base_url=server, timeout=600, limits=limits) as http:
            tasks = [asyncio.create_task(stream(http)) for _ in range(PROBE_STREAMS)]
            await asyncio.sleep(1)  # every stream is in: running or queued
            probes = []
            for _ in range(10):
                for path in ("/health", "/ready", "/metrics"):
                    answer = await asyncio.to_thread(probe, path)
                    probes.append((path, *answer, sum(not t.done() for t in tasks)))
            for task in tasks:  # the clients leave: their streams' generations must be cancelled
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return probes

    def engine() -> dict[str, float]:
        """Running and waiting sequences and tokens generated in the replica's engine, from /metrics."""
        names = ("k3ray:num_requests_running", "k3ray:num_requests_waiting", "k3ray:generation_tokens_total")
        return {k.split("{")[0]: float(v) for k, v in (line.rsplit(" ", 1) for line in
                httpx.get(f"{server}/metrics").text.splitlines() if line.startswith(names))}

    generated_before = engine()["k3ray:generation_tokens_total"]
    pids_before = haproxy_pids()
    probes = asyncio.run(under_load())
    seen = f"probes {probes}; HAProxy processes before {sorted(pids_before)}, after {sorted(haproxy_pids())}"
    loaded = [p for p in probes if p[-1] > 8]  # replica full, requests queued
    print(f"/health, /ready, /metrics under {PROBE_STREAMS} streams: {len(loaded)} probes under full load; {seen}")
    assert len(loaded) >= 6, seen  # the load outlasted two rounds of probes at least
    assert all(status == 200 for _, status, _, _ in probes), seen
    assert all(by == ("listener" if path == "/metrics" else "ingress") for path, _, by, _ in probes), seen
    deadline = time.monotonic() + 300  # generous: generating all 200 x 128 tokens took about 100 s here
    while (now := engine())["k3ray:num_requests_running"] or now["k3ray:num_requests_waiting"]:
        assert time.monotonic() < deadline, f"the closed streams still hold the engine: {now}"
        time.sleep(0.5)
    generated = now["k3ray:generation_tokens_total"] - generated_before
    assert generated < PROBE_STREAMS * 128, f"the closed streams were generated to the end: {generated} tokens"


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green"]}}}


def test_response_format_json_schema_in_chat_and_streaming_completions(client):
    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer"}], n=2, seed=4,
                                       max_tokens=60, response_format=response_format)
    for choice in r.choices:  # the schema bounds the length, so 60 tokens always close it
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = list(client.completions.create(model=MODEL, prompt="Answer:", max_tokens=60, seed=4, stream=True,
                                            extra_body={"response_format": response_format}))
    jsonschema.validate(json.loads("".join(c.text for ch in chunks for c in ch.choices)), SCHEMA)
    cut = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=3, seed=4,
                                    extra_body={"response_format": response_format})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].text.startswith('{"')


def test_json_object_mode_holds_against_a_logit_bias(client):
    # "}" pushed to +100: unconstrained that is "}}}}", JSON mode opens the object first and then closes it
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=8,
                                       response_format={"type": "json_object"}, logit_bias={str(ord("}")): 100})
    assert [c.message.content for c in r.choices] == ["{}", "{}"]


def test_penalties_and_logit_bias_follow_the_processed_logits(client, k3):
    from k3ray.engine.structured.logits_processors import process_logits
    from k3ray.sampling_params import SamplingParams

    prompt, n = "The Ray cluster", 6
    controls = dict(presence_penalty=0.7, frequency_penalty=0.5, logit_bias={str(ord("e")): 3.0})
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **controls,
                                  extra_body={"repetition_penalty": 1.5, "ignore_eos": True})
    params = SamplingParams(repetition_penalty=1.5, **controls)
    ids, out = k3.tokenizer.encode(prompt), []
    for _ in range(n):
        row = process_logits(k3.logits(ids + out)[-1:], [params], [ids + out], [len(ids)])[0]
        out.append(int(row.argmax()))
    assert r.choices[0].text == expected_text(k3, out)


def test_best_of_returns_the_most_likely_samples(client):
    kw = dict(model=MODEL, prompt="Hi", max_tokens=4, temperature=1.0, seed=3, logprobs=0,
              extra_body={"ignore_eos": True})
    every = client.completions.create(n=3, **kw).choices
    best = client.completions.create(n=1, best_of=3, **kw).choices
    top = max(every, key=lambda c: sum(c.logprobs.token_logprobs))
    assert len(best) == 1 and best[0].index == 0 and best[0].text == top.text


@pytest.mark.parametrize("kw, param", [
    ({"suffix": "end"}, "suffix"), ({"best_of": 2, "stream": True}, "best_of"),
    ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}},
     "response_format"),
])
def test_parameters_the_model_cannot_honour_are_refused(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param


def test_a_request_beside_a_50000_string_enum_schema_finishes_while_it_compiles(client, server, k3server_replicas):
    """The enum's grammar takes minutes and gigabytes to compile: it does so in a grammar worker, off
    the engine's step, until a limit makes it a 400; a request sent once the schema waits in the
    engine is answered before it (it used to time out after 120 s); the engine process does not grow."""
    engines = [p for r in k3server_replicas() for p in r.children() if "engine_core_proc" in " ".join(p.cmdline())]
    before = sum(p.memory_info().rss for p in engines)
    schema = {"type": "object", "properties": {"color": {"enum": [f"color-{i:05d}" for i in range(50_000)]}},
              "required": ["color"]}
    with ThreadPoolExecutor(1) as pool:
        large = pool.submit(client.chat.completions.create, model=MODEL, messages=[{"role": "user", "content": "Pick"}],
                            max_tokens=16, response_format={"type": "json_schema",
                                                            "json_schema": {"name": "color", "schema": schema}})
        deadline = time.monotonic() + 120
        while not re.search(r"^k3ray:num_requests_waiting\{[^}]*\} [1-9]", httpx.get(f"{server}/metrics").text, re.M):
            assert time.monotonic() < deadline and not large.done(), "the large schema never waited in the engine"
            time.sleep(0.1)
        r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4 and not large.done(), "answered only once the large one was"
        with pytest.raises(openai.BadRequestError) as e:
            large.result(timeout=300)
    assert e.value.body["param"] == "response_format"
    message = e.value.body["message"]  # the time or the memory limit, whichever this machine's compile hits first
    assert f"within {GRAMMAR_COMPILE_TIMEOUT_S} s (grammar_compile_timeout_s)" in message or \
        "MiB of memory (grammar_compile_memory_bytes)" in message, message
    after = sum(p.memory_info().rss for p in engines if p.is_running())
    assert after - before < 100 * 1024**2, (before, after)


STRICT = {"type": "object", "additionalProperties": False, "required": ["name", "code", "note"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "code": {"type": "string", "pattern": r'^[A-Z]\t"\\[\x00-\x1f]$'},
                         "note": {"enum": ["tab\there", 'quote"', "nul\u0000"]}}}


def test_structured_outputs_are_strict_json_that_validates(client):
    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": "strict", "schema": STRICT}}
    for seed in range(3):  # a bounded string once let raw control characters through on 2 seeds of 3
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}], n=2, seed=seed,
                                           max_tokens=160, response_format=response_format)
        for choice in r.choices:
            text = choice.message.content
            assert choice.finish_reason == "stop" and not any(c < " " for c in text), text
            jsonschema.validate(json.loads(text), STRICT)
    with pytest.raises(openai.BadRequestError) as e:  # a lookahead no grammar can enforce
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "string", "pattern": "(?=a)a"}}})
    assert e.value.body["param"] == "response_format" and "lookaround" in e.value.body["message"]
