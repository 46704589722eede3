"""Tool calling in Kimi K2's format (the shipped fixtures'; K3's XTML: test_serve_xtml.py) on the live
Serve app with the official `openai` client and the random tiny K3:
tool_choice required and a named function give calls whose arguments match 20 generated schemas
(streamed and not, n > 1, the streamed fragments adding up to the same arguments), a tool result
goes back in a second turn, none never calls, and the errors name their field."""

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer import special as sp
from k3ray.tokenizer.tool_calls import MARKERS, marker_ids

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-tools"
MAX_TOKENS = 120  # the generated schemas' arguments take fewer (a call that does not finish fails the test)
USER = [{"role": "user", "content": "What should I call?"}]
NOOP = {"type": "function", "function": {"name": "noop", "description": "does nothing"}}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
SECTION_BEGIN = marker_ids(ByteTokenizer(512))[0]
# bounded values, so the random model's arguments end well within MAX_TOKENS
VALUES = [
    {"type": "string", "maxLength": 3}, {"type": "string", "minLength": 1, "maxLength": 2},
    {"enum": ["red", "green", "blue"]}, {"type": "integer", "minimum": -5, "maximum": 99}, {"type": "boolean"},
    {"type": "null"}, {"const": "fixed"}, {"type": "string", "pattern": "^[a-z]{1,3}$"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]},
    {"type": "number", "minimum": 0, "maximum": 1},
]


def generated_schema(seed: int) -> dict:
    rng = random.Random(seed)
    names = rng.sample(["city", "unit", "count", "flag", "tag", "when", "items", "opt"], rng.randint(1, 3))
    return {"type": "object", "properties": {name: rng.choice(VALUES) for name in names},
            "required": [name for name in names if rng.random() < 0.7]}


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


@pytest.fixture(scope="module")
def server(serve_app, k2_tiny_checkpoint):
    return serve_app({"model": {"model": k2_tiny_checkpoint}, "server": {"served_model_name": MODEL},
                      "engine": {"max_model_len": 1024, "cache_memory_mb": 32, "max_num_seqs": 16}})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def calls_of(message) -> list[tuple[str, str, str]]:
    return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client, **kw) -> list[tuple[str, list, str]]:
    """Per choice: finish_reason, calls (id, name, arguments) from the deltas, content."""
    finish, calls, content = {}, {}, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta, i = choice.delta, choice.index
            content[i] = content.get(i, "") + (delta.content or "")
            for call in delta.tool_calls or []:
                mine = calls.setdefault(i, {})
                if call.index not in mine:  # a call's first delta names it
                    assert call.id and call.type == "function" and call.function.name, call
                    mine[call.index] = [call.id, call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None, call
                mine[call.index][2] += call.function.arguments or ""
            if choice.finish_reason is not None:
                finish[i] = choice.finish_reason
    return [(finish[i], [tuple(c) for _, c in sorted(calls.get(i, {}).items())], content[i]) for i in sorted(finish)]


def test_required_and_named_calls_match_20_generated_schemas_streamed_and_not(client):
    """Each schema's function beside `noop`; required calls either (in parallel every other schema),
    a named tool_choice calls it once; the stream's fragments add up to the same calls. A random
    model may call in parallel until max_tokens: the calls it finished count."""
    def run(seed: int, named: bool) -> list[str]:
        schema, parallel = generated_schema(seed), seed % 2 == 0
        schemas = {f"f{seed}": schema, "noop": NO_ARGUMENTS}
        choice = {"type": "function", "function": {"name": f"f{seed}"}} if named else "required"
        kw = dict(model=MODEL, messages=USER, tools=[tool(f"f{seed}", schema), NOOP], tool_choice=choice, n=2,
                  seed=seed, temperature=1.0, max_tokens=MAX_TOKENS, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(**kw)
        assert len(whole.choices) == 2
        for choice, (finish, calls, content) in zip(whole.choices, streamed(client, **kw)):
            assert choice.finish_reason == finish, (seed, choice)
            complete = calls_of(choice.message)
            if finish == "length":  # the random model went on calling: a cut call is content (streamed, it is sent)
                assert parallel and not named and complete and calls[:len(complete)] == complete, (seed, choice)
                assert len(calls) <= len(complete) + 1
            else:
                assert finish == "tool_calls" and complete == calls, (seed, choice)
                assert choice.message.content is None and content == ""
            assert len(complete) == 1 or (len(complete) > 1 and parallel and not named)
            for call_id, name, arguments in complete:
                assert not named or name == f"f{seed}"
                assert call_id.startswith(f"functions.{name}:")
                jsonschema.validate(json.loads(arguments), schemas[name])
        return [c.finish_reason for c in whole.choices]

    with ThreadPoolExecutor(8) as pool:
        finishes = sum(pool.map(run, [s for s in range(20) for _ in (0, 1)],
                                [n for _ in range(20) for n in (False, True)]), [])
    assert len(finishes) == 80 and finishes.count("tool_calls") >= 60, finishes  # most sections end


def test_a_tool_result_goes_back_in_a_second_turn(client, server):
    tools = [tool("get_weather", {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                  "required": ["city"]}), NOOP]
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=60, seed=3,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    conversation = USER + [message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, tools=tools, max_tokens=8, seed=3)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the model saw the call as it wrote it, then the result under the call's id
    rendered = httpx.post(f"{server}/tokenize", json={"messages": conversation, "tools": tools,
                                                      "return_token_strs": True}, timeout=60).json()
    text = ByteTokenizer(512).decode(rendered["tokens"])
    assert (f"{sp.TOOL_CALL_BEGIN}{call.id}{sp.TOOL_CALL_ARGUMENT_BEGIN}{call.function.arguments}{sp.TOOL_CALL_END}"
            in text)
    assert f"## Return of {call.id}\n" + '{"temperature": 21}' in text
    assert second.usage.prompt_tokens == rendered["count"]


def test_none_never_calls(client):
    """Even a model pushed to open a call section: the output stops where it would start."""
    tools = [tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}), NOOP]
    for bias in (None, {str(SECTION_BEGIN): 100}):
        kw = dict(model=MODEL, messages=USER, tools=tools, tool_choice="none", n=3, seed=5, max_tokens=24,
                  logit_bias=bias, extra_body={"skip_special_tokens": False})
        whole = client.chat.completions.create(**kw)
        for choice, (finish, calls, content) in zip(whole.choices, streamed(client, **kw)):
            assert choice.message.tool_calls is None and calls == []
            assert choice.finish_reason == finish != "tool_calls"
            assert choice.message.content == content and sp.TOOL_CALLS_SECTION_BEGIN not in content
            if bias:
                assert (choice.finish_reason, choice.stop_reason, content) == ("stop", SECTION_BEGIN, "")


def test_auto_lets_the_model_write_text(client):
    """The random model never writes a well-formed call: its text is content, no marker in it."""
    kw = dict(model=MODEL, messages=USER, tools=[NOOP], n=2, seed=7, max_tokens=24,
              logit_bias={str(SECTION_BEGIN): 8})  # sections it opens hold no call
    whole = client.chat.completions.create(**kw)
    for choice, (finish, calls, content) in zip(whole.choices, streamed(client, **kw)):
        assert choice.message.tool_calls is None and calls == [] and choice.finish_reason == finish
        assert choice.message.content == content and not any(m in content for m in MARKERS)  # all dropped


def test_tokenize_renders_the_tools(server):
    tools = [tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
    with_tools = httpx.post(f"{server}/tokenize", json={"messages": USER, "tools": tools}, timeout=60).json()
    plain = httpx.post(f"{server}/tokenize", json={"messages": USER}, timeout=60).json()
    tok = ByteTokenizer(512)
    assert with_tools["tokens"] == tok.encode_chat(USER, tools=tools)
    assert with_tools["count"] > plain["count"] and "tool_declare" in tok.decode(with_tools["tokens"])


def bad_request(call) -> tuple[str | None, str]:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body["param"], e.value.body["message"]


@pytest.mark.parametrize("fields, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of tools"),
    ({"tools": [tool("f", {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?i)a"}}})]},
     "tools", "tools[0].function.parameters: pattern '(?i)a'"),
    ({"tools": [tool("f", {"type": "objectx"})]}, "tools", "tools[0].function.parameters is not a usable"),
    ({"tools": [NOOP, NOOP]}, "tools", "unique"),
    ({"tools": [tool("a.b")]}, "tools[0].function.name", "should match pattern"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"tool_choice": "required", "extra_body": {"ignore_eos": True}}, "tool_choice", "ignore_eos cannot be combined"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, fields, param, says):
    kw = {"model": MODEL, "messages": USER, "tools": [NOOP], "max_tokens": 4, **fields}
    got_param, message = bad_request(lambda: client.chat.completions.create(**{k: v for k, v in kw.items()
                                                                              if v is not None}))
    assert got_param == param and says in message, message


def test_tools_on_completions_are_400(client):
    for field, value in (("tools", [NOOP]), ("tool_choice", "auto")):
        param, message = bad_request(lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                                       extra_body={field: value}))
        assert param == field and "/v1/chat/completions" in message


def test_the_openapi_document_describes_tool_calling(server):
    document = httpx.get(f"{server}/openapi.json", timeout=60).json()
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)
    assert schemas["FunctionDefinition"]["properties"]["name"]["pattern"] == "^[A-Za-z0-9_-]{1,64}$"
    assert "tools" in schemas["TokenizeRequest"]["properties"]
    assert schemas["CompletionRequest"]["properties"]["tools"]["type"] == "null"  # a 400 there
    (answer,) = document["paths"]["/v1/chat/completions"].values()
    message = answer["responses"]["200"]["content"]["application/json"]["schema"]["properties"]["choices"]
    call = message["items"]["properties"]["message"]["properties"]["tool_calls"]["items"]
    assert call["required"] == ["id", "type", "function"]
