"""POST /v1/messages (Anthropic's Messages API) on the live Serve app with the official `anthropic`
client and the random tiny K3 (its text is noise; a forcing tool_choice constrains decoding to a
well-formed call): a plain message, thinking on and off, a tool_use / tool_result round trip, a stream
whose final message is the whole one's, stop sequences, count_tokens, Anthropic-shaped errors and
the x-api-key header. Then the conversions alone, without a server, and an unavailable model in process."""

import asyncio
import json
from types import SimpleNamespace

import anthropic
import httpx
import pytest

from k3ray.actors.openai import messages as messages_module
from k3ray.actors.openai.messages import MessageEvents, chat_request, message_body
from k3ray.actors.openai.messages_protocol import MessagesRequest

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-messages"
KEY = "messages-key"
USER = [{"role": "user", "content": "What should I call?"}]
OFF = {"type": "disabled"}
CALL_TOKENS = 160  # a forced call in K3's format takes about 120 byte tokens
WEATHER = {"name": "get_weather", "description": "the weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}
NOOP = {"name": "noop", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def server(serve_app, tiny_checkpoint):
    return serve_app({"model": {"model": tiny_checkpoint}, "server": {"served_model_name": MODEL, "api_key": KEY},
                      "engine": {"max_model_len": 2048, "cache_memory_mb": 64, "max_num_seqs": 16}})


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=300)  # sends x-api-key


def anthropic_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return body["error"]


def test_a_plain_message(client):
    message = client.messages.create(model=MODEL, max_tokens=8, messages=USER, system="Answer briefly.",
                                     metadata={"user_id": "u1"},
                                     extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})  # this SDK lacks them
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None and 0 < message.usage.output_tokens <= 8
    assert message.usage.input_tokens > 10
    assert {b.type for b in message.content} <= {"thinking", "text"}


def test_thinking_blocks_with_thinking_on_and_none_with_it_off(client):
    for thinking in (None, {"type": "enabled", "budget_tokens": 2048}):
        kw = {"thinking": thinking} if thinking else {}
        on = client.messages.create(model=MODEL, max_tokens=8, messages=USER, extra_body={"seed": 1}, **kw)
        assert on.content[0].type == "thinking" and on.content[0].thinking, on
        assert isinstance(on.content[0].signature, str)
    off = client.messages.create(model=MODEL, max_tokens=8, messages=USER, thinking=OFF, extra_body={"seed": 1})
    assert all(b.type == "text" for b in off.content) and off.content, off
    # a thinking block sent back is rendered as the turn's reasoning; a redacted one is dropped
    history = USER + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"}, {"type": "redacted_thinking", "data": "x"},
        {"type": "text", "text": "Nothing."}]}, {"role": "user", "content": "Sure?"}]
    assert client.messages.create(model=MODEL, max_tokens=4, messages=history).usage.output_tokens > 0


def test_a_tool_use_and_its_result_round_trip(client):
    first = client.messages.create(model=MODEL, max_tokens=CALL_TOKENS, messages=USER, tools=[WEATHER, NOOP],
                                   tool_choice={"type": "tool", "name": "get_weather"}, thinking=OFF,
                                   extra_body={"seed": 3})
    assert first.stop_reason == "tool_use", first
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo") and use.id
    conversation = USER + [{"role": "assistant", "content": first.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "21 degrees"}]},
        {"type": "text", "text": "And tomorrow?"}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, messages=conversation, tools=[WEATHER, NOOP],
                                    extra_body={"seed": 3})
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=conversation, tools=[WEATHER, NOOP])
    assert counted.input_tokens == second.usage.input_tokens > first.usage.input_tokens
    errored = conversation[:-1] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "no network", "is_error": True}]}]
    assert client.messages.create(model=MODEL, max_tokens=2, messages=errored).usage.output_tokens > 0
    # any: one or more calls of the tools
    calls = client.messages.create(model=MODEL, max_tokens=CALL_TOKENS, messages=USER, tools=[WEATHER, NOOP],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking=OFF,
                                   extra_body={"seed": 4})
    assert calls.stop_reason == "tool_use" and [b.type for b in calls.content] == ["tool_use"], calls


@pytest.mark.parametrize("kw", [
    {"max_tokens": 12},
    {"max_tokens": 12, "thinking": OFF},
    {"max_tokens": CALL_TOKENS, "thinking": OFF, "tools": [WEATHER, NOOP], "tool_choice": {"type": "any"}},
], ids=["thinking", "text", "tool_use"])
def test_the_streamed_message_is_the_whole_one(client, kw):
    kw = dict(model=MODEL, messages=USER, extra_body={"seed": 11}, **kw)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert streamed.id.startswith("msg_")
    events = [e.type for e in client.messages.create(stream=True, **kw)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"], events
    assert events.count("content_block_start") == events.count("content_block_stop") == len(whole.content)


def test_stop_sequences(client):
    printable = [chr(c) for c in range(33, 127)]
    message = client.messages.create(model=MODEL, max_tokens=64, messages=USER, thinking=OFF,
                                     stop_sequences=printable, extra_body={"seed": 5})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence in printable, message


def test_errors_are_anthropic_shaped(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:  # a tool_result without its tool_use
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "toolu_1" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=USER, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=4, messages=USER)
    headers = {"x-api-key": KEY}
    missing = anthropic_error(httpx.post(f"{server}/v1/messages", json={"model": MODEL, "messages": USER},
                                         headers=headers), 400)
    assert missing["type"] == "invalid_request_error" and "max_tokens" in missing["message"]
    for body in ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
                 {"model": MODEL, "max_tokens": 4, "messages": USER, "tool_choice": {"type": "any"}},
                 {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]}):
        anthropic_error(httpx.post(f"{server}/v1/messages", json=body, headers=headers), 400)
    anthropic_error(httpx.post(f"{server}/v1/messages", content=b"{not json", headers=headers), 400)
    anthropic_error(httpx.get(f"{server}/v1/messages", headers=headers), 405)


def test_x_api_key_or_bearer(client, server):
    body = {"model": MODEL, "max_tokens": 1, "messages": USER}
    assert anthropic_error(httpx.post(f"{server}/v1/messages", json=body), 401)["type"] == "authentication_error"
    anthropic_error(httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": "wrong"}), 401)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**body)
    assert httpx.post(f"{server}/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{server}/v1/models", headers={"x-api-key": KEY}).status_code == 200  # the OpenAI routes too
    assert httpx.get(f"{server}/v1/models").json()["error"]["code"] == "invalid_api_key"  # in their own shape


# the conversions alone --------------------------------------------------------------------------
def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": USER, **fields})


def test_a_request_becomes_a_chat_request():
    png = {"type": "base64", "media_type": "image/png", "data": "iVBO"}
    chat = chat_request(request(
        system=[{"type": "text", "text": "Be brief."}], stop_sequences=["END"], temperature=0.0, top_k=5,
        thinking={"type": "enabled", "budget_tokens": 1024}, tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "source": png},
                                         {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "The weather.", "signature": "s"},
                {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "Here:"},
                {"type": "tool_result", "tool_use_id": "functions.get_weather:0", "content": "21", "is_error": True},
                {"type": "text", "text": "Thanks."}]},
        ]))
    dumped = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert dumped == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "The weather.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "user", "content": [{"type": "text", "text": "Here:"}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Error: 21"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"] and chat.tools[0].function.name == "get_weather"
    assert chat.chat_template_kwargs == {"thinking": True} and chat.stop == ["END"]
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.add_generation_prompt) == (4, 0.0, 5, True)


def test_tool_choice_thinking_and_prefill():
    named = chat_request(request(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, thinking=OFF))
    assert named.tool_choice.function.name == "get_weather" and named.chat_template_kwargs == {"thinking": False}
    assert chat_request(request(tools=[WEATHER], tool_choice={"type": "none"})).tool_choice == "none"
    assert chat_request(request(thinking={"type": "adaptive"})).chat_template_kwargs is None
    prefill = chat_request(request(messages=USER + [{"role": "assistant", "content": "The answer is"}]))
    assert prefill.continue_final_message and not prefill.add_generation_prompt


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]}],
    USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b"}]}],
    USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": [{"type": "tool_result",
                                                                                 "tool_use_id": "a"}]}],
])
def test_a_tool_result_answers_the_last_assistant_messages_tool_use(messages):
    with pytest.raises(Exception) as e:
        chat_request(request(messages=messages))
    assert getattr(e.value, "status", None) == 400 and "tool_use_id" in str(e.value)


def chat_answer(message: dict, finish_reason: str, stop_reason=None) -> dict:
    return {"id": "msg-abc", "model": MODEL, "usage": {"prompt_tokens": 7, "completion_tokens": 3},
            "choices": [{"message": message, "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def test_a_chat_answer_becomes_a_message():
    message = message_body(chat_answer({"content": "Hi", "reasoning_content": "Think.", "tool_calls": [
        {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        "tool_calls"))
    assert message == {"id": "msg_abc", "type": "message", "role": "assistant", "model": MODEL, "content": [
        {"type": "thinking", "thinking": "Think.", "signature": ""}, {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "functions.f:0", "name": "f", "input": {"x": 1}}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 3}}
    stopped = message_body(chat_answer({"content": "a"}, "stop", "END"), ["END"])
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    # a stop string of the chat format itself is the end of the turn
    assert message_body(chat_answer({"content": "a"}, "stop", "<|close|>"), ["END"])["stop_reason"] == "end_turn"
    assert message_body(chat_answer({"content": None}, "length"))["stop_reason"] == "max_tokens"


def chunk(delta: dict, finish_reason=None, stop_reason=None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "stop_reason": stop_reason}]}


def test_chat_chunks_become_content_block_events():
    events = MessageEvents("msg_1", MODEL, 9, None)
    out = events.start()
    for c in (chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "a"}),
              chunk({"reasoning_content": "b"}), chunk({"content": "c"}),
              chunk({"tool_calls": [{"index": 0, "id": "functions.f:0", "type": "function",
                                     "function": {"name": "f", "arguments": '{"x"'}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"),
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}}):
        out += events.chunk(c)
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in out] == [
        ("message_start", None, None),
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert out[0]["message"]["usage"] == {"input_tokens": 9, "output_tokens": 0}
    assert out[8]["content_block"] == {"type": "tool_use", "id": "functions.f:0", "name": "f", "input": {}}
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"] == {"output_tokens": 5}


def test_a_failure_mid_stream_is_an_error_event(monkeypatch):
    async def failing(serving, turn):
        yield chunk({"content": "x"})
        raise RuntimeError("stage lost")

    async def events() -> str:
        turn = SimpleNamespace(request_id="msg-1", prompt=SimpleNamespace(num_tokens=3))
        return "".join([e async for e in messages_module._events(SimpleNamespace(model_name=MODEL), turn, None)])

    monkeypatch.setattr(messages_module, "chat_chunks", failing)
    text = asyncio.run(events())
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    assert json.loads(last.split("data: ", 1)[1])["error"]["type"] == "api_error"


def test_an_unavailable_model_answers_503_or_an_error_event(tiny_checkpoint):
    """In process: an engine whose pipeline lost an actor answers with the app's Retry-After."""
    from fastapi.testclient import TestClient

    from k3ray.actors.openai.routes import build_openai_app
    from k3ray.actors.openai.serving import OpenAIServing
    from k3ray.actors.pipeline.protocol import StageFailure
    from k3ray.engine import AsyncEngine, EngineConfig, LLMEngine, LocalExecutor
    from k3ray.tokenizer import load_tokenizer
    from k3ray.weights import load_model

    def lost_stage(plan):
        raise StageFailure("model step failed: an actor of the pipeline died")

    executor = LocalExecutor(load_model(tiny_checkpoint))
    executor.execute = lost_stage
    engine = LLMEngine(executor, EngineConfig(num_blocks=128, block_size=8, max_model_len=1024),
                       load_tokenizer(tiny_checkpoint))
    app = build_openai_app(OpenAIServing(AsyncEngine(engine), engine.tokenizer, MODEL), retry_after_s=2)
    body = {"model": MODEL, "max_tokens": 4, "messages": USER}
    with TestClient(app) as http:
        answer = http.post("/v1/messages", json=body)
        assert anthropic_error(answer, 503)["type"] == "overloaded_error" and answer.headers["retry-after"] == "2"
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
    assert events[0] == "event: message_start" and events[-2] == "event: error", events
    assert json.loads(events[-1].removeprefix("data: "))["error"]["type"] == "overloaded_error"
