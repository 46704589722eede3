"""POST /v1/responses: the conversions to and from the chat path without a server, then the live Serve
app with the official `openai` client and the random tiny K3: plain input with instructions, a function
call round trip, streamed events whose final Response is the unstreamed one, reasoning items on and off,
a json_schema text format, and the 400s of what a stateless server cannot do."""

import json
from typing import get_args

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from k3ray.actors.openai.errors import APIError
from k3ray.actors.openai.responses_convert import (
    chat_messages,
    chat_request,
    response_body,
    responses_error,
)
from k3ray.actors.openai.responses_protocol import ResponsesRequest  # noqa: E402
from k3ray.actors.openai.responses_stream import ResponseEvents  # noqa: E402

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
# a forced call, thinking off (the random model's thinking runs to any limit), seeded (at temperature 0 it
# loops inside the call's grammar)
FORCED = dict(reasoning={"effort": "none"}, temperature=1.0, extra_body={"seed": 1}, max_output_tokens=120,
              parallel_tool_calls=False)
EVENT_TYPES = {cls.model_fields["type"].annotation.__args__[0]: cls
               for cls in get_args(get_args(ResponseStreamEvent)[0])}


def typed_event(payload: dict):
    """The openai client's event model of payload's type, validated (not just constructed)."""
    return EVENT_TYPES[payload["type"]].model_validate(payload)


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


# conversions, no server -----------------------------------------------------------------------
def test_string_input_and_instructions_are_a_system_and_a_user_message():
    assert chat_messages(request(input="hello", instructions="be brief")) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": "data:image/png;base64,x"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}],
         "content": [{"type": "reasoning_text", "text": "long"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling",
                                                              "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "again"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    def call(i, name, args):
        return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
    assert chat_messages(request(input=items)) == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "calling"}], "reasoning_content": "long",
         "tool_calls": [call("c1", "f", "{}"), call("c2", "g", '{"x":1}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None, "reasoning_content": "again", "tool_calls": [call("c3", "f", "{}")]},
    ]


@pytest.mark.parametrize("items, param", [
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id"),
    ([{"type": "reasoning", "summary": []}], "input"),
])
def test_input_that_answers_nothing_is_400(items, param):
    with pytest.raises(APIError) as e:
        chat_messages(request(input=items))
    assert e.value.status == 400 and e.value.param == param


def test_the_request_fields_map_onto_a_chat_request():
    chat = chat_request(request(
        tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=9,
        temperature=0.5, top_p=0.9, seed=7, parallel_tool_calls=False, reasoning={"effort": "none"}, user="u",
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}}))
    assert (chat.max_tokens, chat.seed, chat.temperature, chat.top_p, chat.user) == (9, 7, 0.5, 0.9, "u")
    assert chat.parallel_tool_calls is False and chat.reasoning_effort == "none"
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.tool_choice.function.name == "get_weather"
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.json_schema == \
        {"type": "object"}
    assert chat_request(request(text={"format": {"type": "json_object"}})).response_format.type == "json_object"


@pytest.mark.parametrize("fields, says", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "web_search"), ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
])
def test_what_a_stateless_server_cannot_do_fails_validation(fields, says):
    with pytest.raises(ValueError, match=says):
        request(**fields)
    request(store=False)


def test_chat_errors_name_the_responses_fields():
    e = responses_error(APIError(400, "max_tokens must be below 96", "max_tokens", "context_length_exceeded"))
    assert (e.param, e.message, e.code) == ("max_output_tokens", "max_output_tokens must be below 96",
                                            "context_length_exceeded")
    assert responses_error(APIError(400, "bad", "messages[2].content")).param == "input"
    assert responses_error(APIError(400, "response_format.json_schema.schema: no", "response_format")).message == \
        "text.format.schema: no"


CHAT = {"id": "resp-1", "object": "chat.completion", "created": 1, "model": MODEL, "choices": [{
    "index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}


def test_a_chat_completion_becomes_a_response_the_client_parses():
    req = request(tools=[WEATHER], instructions="sys", metadata={"k": "v"}, max_output_tokens=20)
    body = Response.model_validate(response_body(req, CHAT, "resp_1", 1, MODEL))
    assert body.status == "completed" and body.incomplete_details is None and body.store is False
    reasoning, call = body.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "think" and reasoning.summary == []
    assert (call.type, call.call_id, call.name, call.arguments) == \
        ("function_call", "functions.get_weather:0", "get_weather", '{"city": "Oslo"}')
    assert (body.usage.input_tokens, body.usage.output_tokens, body.usage.total_tokens) == (5, 7, 12)
    assert body.tools[0].name == "get_weather" and body.instructions == "sys" and body.metadata == {"k": "v"}
    assert body.max_output_tokens == 20 and body.parallel_tool_calls and body.output_text == ""
    cut = {**CHAT, "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant",
                                                                                    "content": "abc"}}]}
    body = Response.model_validate(response_body(req, cut, "resp_2", 1, MODEL))
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert body.output_text == "abc"


def chunk(delta: dict | None = None, finish_reason: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    return {"id": "resp-1", "choices": choices, **({"usage": usage} if usage else {})}


def test_chunks_become_typed_events_ending_in_the_whole_response():
    req = request(tools=[WEATHER])
    events = ResponseEvents(req, "resp_1", 1, MODEL)
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "th"}),
              chunk({"reasoning_content": "ink"}), chunk({"content": "ok"}),
              chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city"'}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}, "tool_calls"),
              chunk(usage=CHAT["usage"])]
    text = "".join([*events.start(), *(e for c in chunks for e in events.chunk(c)), *events.finish()])
    parsed = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {payload['type']}"
        parsed.append(typed_event(payload))
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = parsed[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "think" and final.output_text == "ok"
    assert final.output[2].arguments == '{"city": "Oslo"}' and final.usage.total_tokens == 12
    assert [e.output_index for e in parsed if e.type == "response.output_item.done"] == [0, 1, 2]


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    events = ResponseEvents(request(), "resp_1", 1, MODEL)
    list(events.start())
    list(events.chunk(chunk({"content": "partial"})))
    error, failed = [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in
                     "".join(events.fail(RuntimeError("boom"))).strip().split("\n\n")]
    assert error["type"] == "error" and "boom" in error["message"]
    failed = typed_event(failed)
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error"


# the live server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(serve_app, tiny_checkpoint):
    return serve_app({"model": {"model": tiny_checkpoint}, "server": {"served_model_name": MODEL},
                      "engine": {"max_model_len": 1024, "cache_memory_mb": 32, "max_num_seqs": 8}})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def tokens(server: str, req: ResponsesRequest) -> int:
    """The prompt's tokens as /tokenize counts the chat messages the request becomes."""
    tools = [t.model_dump(exclude_none=True) for t in chat_request(req).tools or []]
    body = {"messages": chat_messages(req), **({"tools": tools} if tools else {})}
    answer = httpx.post(f"{server}/tokenize", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["count"]


def without_ids(response) -> list[dict]:
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"} for item in response.output]


def test_string_input_with_instructions(client, server):
    response = client.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.", max_output_tokens=8,
                                       temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status in ("completed", "incomplete") and isinstance(response.output_text, str)
    assert response.output[-1].type == "message" and response.usage.output_tokens <= 8
    assert response.usage.input_tokens == tokens(server, request(input="Say hi.", instructions="Be brief."))
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.store is False and response.temperature == 0 and response.max_output_tokens == 8


def test_a_function_call_round_trip(client, server):
    user = [{"role": "user", "content": "Weather in Oslo?"}]
    first = client.responses.create(model=MODEL, input=user, tools=[WEATHER], **FORCED,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert first.status == "completed", first.output
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed" and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    items = user + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}]
    second = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens == tokens(server, request(input=items, tools=[WEATHER]))


def streamed(client, **kw) -> tuple[list, object]:
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


@pytest.mark.parametrize("kw", [
    dict(input="Tell me a story.", max_output_tokens=12),
    dict(input="Weather?", tools=[WEATHER], tool_choice="required", **FORCED),
], ids=["text", "function_call"])
def test_a_stream_ends_in_the_unstreamed_response(client, kw):
    """Greedy, or seeded (a forced call at temperature 0 lets the random model loop inside the grammar)."""
    kw = dict(model=MODEL, **{"temperature": 0, **kw})
    events, final = streamed(client, **kw)
    whole = client.responses.create(**kw)
    assert without_ids(final) == without_ids(whole) and final.status == whole.status
    assert final.usage == whole.usage
    if "tools" in kw:
        assert final.status == "completed" and final.output[-1].type == "function_call", final
    deltas = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            deltas[e.item_id] = deltas.get(e.item_id, "") + e.delta
    for item in final.output:
        text = {"reasoning": lambda: item.content[0].text, "message": lambda: item.content[0].text,
                "function_call": lambda: item.arguments}[item.type]()
        assert deltas.get(item.id, "") == text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.model_dump() for item in done] == [item.model_dump() for item in final.output]


def test_reasoning_items_with_thinking_on_and_none_with_effort_none(client):
    on = client.responses.create(model=MODEL, input="Think.", max_output_tokens=8, temperature=0)
    off = client.responses.create(model=MODEL, input="Think.", max_output_tokens=8, temperature=0,
                                  reasoning={"effort": "none"})
    assert on.output[0].type == "reasoning" and on.output[0].content[0].text
    assert on.reasoning.effort is None and off.reasoning.effort == "none"
    assert [item.type for item in off.output] == ["message"]


def test_a_json_schema_text_format_is_followed(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Pick a color.", max_output_tokens=40, temperature=0,
                                       reasoning={"effort": "none"},
                                       text={"format": {"type": "json_schema", "name": "pick", "schema": schema,
                                                        "strict": True}})
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("fields, param, says", [
    ({"previous_response_id": "resp_123"}, "previous_response_id", "stateless"),
    ({"store": True}, "store", "stateless"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0]", "web_search_preview"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input[0].call_id", "c9"),
    ({"max_output_tokens": 1024}, "max_output_tokens", "context length"),
    ({"model": "other"}, "model", "other"),
])
def test_what_cannot_be_served_is_a_4xx_naming_it(client, fields, param, says):
    kw = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(**kw)
    assert e.value.status_code == (404 if param == "model" else 400), e.value.body
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


def test_the_route_is_documented_with_its_stream(server):
    paths = httpx.get(f"{server}/openapi.json", timeout=60).json()["paths"]
    content = paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert content["application/json"]["schema"]["properties"]["object"] == {"const": "response"}
    assert content["text/event-stream"]["schema"]["required"] == ["event", "data"]
