"""K3's XTML chat format on the live Serve app with the official `openai` client and the random tiny K3
(whose tokenizer has K3's special tokens): thinking comes back as `reasoning_content` and never in
`content`, tool_choice required and named give calls whose arguments match 20 generated schemas
(streamed and not), streamed output equals the whole answer for a seed, a call cut by max_tokens
stays out of content, /tokenize renders K3's prompt with the request's options, and bad options are
400s naming their field."""

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer import special as sp
from k3ray.tokenizer.chat_options import ChatOptions

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-xtml"
K3 = ByteTokenizer(512, "kimi_k3_xtml")
CLOSE = str(K3.special_tokens[sp.CLOSE])
USER = [{"role": "user", "content": "What should I call?"}]
OFF = {"chat_template_kwargs": {"thinking": False}}
MARKUP = (sp.OPEN, sp.CLOSE, sp.SEP, sp.END_OF_MSG)
VALUES = [  # bounded values, so the random model's arguments end within max_tokens
    {"type": "string", "maxLength": 3}, {"enum": ["red", "green", "blue"]},
    {"type": "integer", "minimum": -5, "maximum": 99}, {"type": "boolean"}, {"type": "null"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
    {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]},
    {"type": "number", "minimum": 0, "maximum": 1},
]


def generated_schema(seed: int) -> dict:
    rng = random.Random(seed)
    names = rng.sample(["city", "unit", "count", "flag", "tag", "items"], rng.randint(1, 3))
    return {"type": "object", "properties": {name: rng.choice(VALUES) for name in names},
            "required": [name for name in names if rng.random() < 0.7]}


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


@pytest.fixture(scope="module")
def server(serve_app, tiny_checkpoint):
    return serve_app({"model": {"model": tiny_checkpoint}, "server": {"served_model_name": MODEL},
                      "engine": {"max_model_len": 2048, "cache_memory_mb": 32, "max_num_seqs": 16}})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def streamed(client, **kw) -> dict:
    """The stream's choice 0 added up: reasoning, content, calls (id, name, arguments), finish_reason."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            out["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in out["calls"]:
                    out["calls"][call.index] = [call.id, call.function.name, ""]
                out["calls"][call.index][2] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [tuple(c) for _, c in sorted(out["calls"].items())]
    return out


def whole(message, finish: str) -> dict:
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return {"reasoning": getattr(message, "reasoning_content", None) or "", "content": message.content or "",
            "calls": calls, "finish": finish}


def test_thinking_is_reasoning_content_never_content(client):
    """The prompt opens the think channel: the output starts inside it. Biased to close it soon, the
    model also writes a response; neither holds markup, and the stream adds up to the whole answer."""
    for seed in range(4):
        kw = dict(model=MODEL, messages=USER, max_tokens=48, seed=seed, temperature=1.0, logit_bias={CLOSE: 4})
        answer = client.chat.completions.create(**kw).choices[0]
        got = whole(answer.message, answer.finish_reason)
        assert got["reasoning"], got
        assert not any(m in got["reasoning"] + got["content"] for m in MARKUP), got
        assert got["reasoning"] not in got["content"] or not got["content"]
        assert streamed(client, **kw) == got


def test_a_continued_response_is_content_not_reasoning(client):
    """continue_final_message leaves the final message's response channel open: with thinking on, the
    output continues the response (content), not the think channel."""
    messages = USER + [{"role": "assistant", "content": "The answer is"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, seed=2,
              extra_body={"continue_final_message": True, "add_generation_prompt": False})
    message = client.chat.completions.create(**kw).choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
    assert streamed(client, **kw)["reasoning"] == ""


def test_thinking_off_has_no_reasoning(client):
    for fields in (OFF, {"reasoning_effort": "none"}):
        kw = dict(model=MODEL, messages=USER, max_tokens=16, seed=1, extra_body=fields)
        message = client.chat.completions.create(**kw).choices[0].message
        assert getattr(message, "reasoning_content", None) is None and message.content is not None
        assert streamed(client, **kw)["reasoning"] == ""


def test_required_and_named_calls_match_20_generated_schemas(client):
    """Thinking off, so the random model goes straight to the tools channel; each call's arguments
    validate against its function's schema, streamed and not (8 requests at once: the engine batches them)."""
    def run(seed: int) -> str:
        schema = generated_schema(seed)
        named = seed % 2 == 1
        choice = {"type": "function", "function": {"name": f"f{seed}"}} if named else "required"
        kw = dict(model=MODEL, messages=USER, tools=[tool(f"f{seed}", schema), tool("noop")], tool_choice=choice,
                  seed=seed, temperature=1.0, max_tokens=160, parallel_tool_calls=named or seed % 4 == 0,
                  extra_body=OFF)
        answer = client.chat.completions.create(**kw).choices[0]
        got = whole(answer.message, answer.finish_reason)
        assert streamed(client, **kw) == got, seed
        assert got["content"] == "" and not any(m in got["reasoning"] for m in MARKUP)
        for index, (call_id, name, arguments) in enumerate(got["calls"]):
            assert call_id == f"functions.{name}:{index}"
            assert not named or name == f"f{seed}"
            jsonschema.validate(json.loads(arguments), schema if name == f"f{seed}" else {"type": "object"})
        return got["finish"]

    with ThreadPoolExecutor(8) as pool:
        finishes = list(pool.map(run, range(20)))
    assert finishes.count("tool_calls") >= 16, finishes


def test_thinking_then_a_required_call(client):
    """Thinking on: free reasoning first (biased to end soon), then the call."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    kw = dict(model=MODEL, messages=USER, tools=[tool("get_weather", schema)], tool_choice="required", seed=2,
              max_tokens=200, logit_bias={CLOSE: 6})
    answer = client.chat.completions.create(**kw).choices[0]
    assert answer.finish_reason == "tool_calls", answer
    (call,) = answer.message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert streamed(client, **kw) == whole(answer.message, answer.finish_reason)


@pytest.mark.parametrize("thinking", [False, True])
def test_response_format_is_the_response_channel(client, thinking):
    """The grammar holds the JSON answer in the response channel, after the reasoning when thinking."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    kw = dict(model=MODEL, messages=USER, max_tokens=120, seed=4, logit_bias={CLOSE: 6},
              response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
              extra_body={"chat_template_kwargs": {"thinking": thinking}})
    answer = client.chat.completions.create(**kw).choices[0]
    assert answer.finish_reason == "stop", answer
    jsonschema.validate(json.loads(answer.message.content), schema)
    assert bool(getattr(answer.message, "reasoning_content", None)) == thinking
    assert streamed(client, **kw) == whole(answer.message, answer.finish_reason)


def test_a_call_cut_by_max_tokens_stays_out_of_content(client):
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}}}}
    kw = dict(model=MODEL, messages=USER, tools=[tool("f", schema)], tool_choice="required", seed=0,
              max_tokens=40, parallel_tool_calls=True, extra_body=OFF)
    answer = client.chat.completions.create(**kw).choices[0]
    got = whole(answer.message, answer.finish_reason)
    assert got["finish"] == "length" and got["content"] == "", got
    assert streamed(client, **kw)["content"] == ""


def test_a_tool_result_goes_back_in_a_second_turn(client, server):
    tools = [tool("get_weather", {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                  "required": ["city"]})]
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=200, seed=3, parallel_tool_calls=False,
                                           tool_choice="required", extra_body=OFF)
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = message.model_dump(exclude_none=True)
    history["reasoning_content"] = "I should look it up."
    conversation = USER + [history, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, tools=tools, max_tokens=8, seed=3)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = httpx.post(f"{server}/tokenize", json={"messages": conversation, "tools": tools}, timeout=60).json()
    text = K3.decode(rendered["tokens"])
    city = json.loads(call.function.arguments)["city"]
    assert ('<|open|>think<|sep|>I should look it up.<|close|>think<|sep|>' in text  # reasoning rendered back
            and f'<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>'
                f'{city}<|close|>argument<|sep|>' in text)
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>{"temperature": 21}' in text
    assert second.usage.prompt_tokens == rendered["count"]


def test_tool_choice_none_stops_at_the_tools_channel(client):
    kw = dict(model=MODEL, messages=USER, tools=[tool("noop")], tool_choice="none", seed=5, max_tokens=24)
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.tool_calls is None


@pytest.mark.parametrize("fields", [
    {}, {"chat_template_kwargs": {"thinking": False}}, {"chat_template_kwargs": {"thinking_effort": "low"}},
    {"reasoning_effort": "high"}, {"tool_choice": "required"}, {"response_format": {"type": "json_object"}},
])
def test_tokenize_renders_k3s_prompt_with_the_options(server, fields):
    tools = [tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})]
    got = httpx.post(f"{server}/tokenize", json={"messages": USER, "tools": tools, **fields}, timeout=60).json()
    kwargs = fields.get("chat_template_kwargs", {})
    effort = {"high": "high"}.get(fields.get("reasoning_effort"), kwargs.get("thinking_effort", "max"))
    options = ChatOptions(thinking=kwargs.get("thinking"), thinking_effort=effort,
                          tool_choice=fields.get("tool_choice", "auto"), response_format=fields.get("response_format"))
    assert got["tokens"] == K3.encode_chat(USER, tools=tools, options=options)


def bad_request(call) -> tuple[str | None, str]:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body["param"], e.value.body["message"]


@pytest.mark.parametrize("fields, param, says", [
    ({"extra_body": {"chat_template_kwargs": {"thinking_effort": "medium"}}}, "chat_template_kwargs", "low, high, max"),
    ({"extra_body": {"chat_template_kwargs": {"thinking": "yes"}}}, "chat_template_kwargs", "true or false"),
    ({"extra_body": {"chat_template_kwargs": {"temperature": 1}}}, "chat_template_kwargs", "unknown keys"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of tools"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, "messages",
     "JSON object"),
    ({"messages": USER + [{"role": "tool", "content": "r", "tool_call_id": "x"}]}, "messages", "answers no tool call"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions", "tools"),
    ({"max_tokens": 100000, "max_completion_tokens": 4}, "max_tokens", "context length"),
])
def test_bad_requests_are_400_naming_the_field(client, fields, param, says):
    kw = {"model": MODEL, "messages": USER, "tools": [tool("noop")], "max_tokens": 4, **fields}
    got_param, message = bad_request(lambda: client.chat.completions.create(**kw))
    assert got_param == param and says in message, message


def test_eval_chat_scores_content_as_the_in_process_engine(server, tiny_checkpoint, tmp_path):
    """`k3ray eval --chat --chat-template-kwargs '{"thinking": false}'` on K3's format: each prompt is
    the cell's length by the server's count of K3's prompt, and the endpoint's answers (its content)
    equal the in-process engine's reading of the same ids' output."""
    from k3ray.actors.serve.config import ServeArgs
    from k3ray.actors.serve.engine import build_engine
    from k3ray.evals.engine_target import EngineTarget
    from k3ray.evals.openai_target import OpenAITarget
    from k3ray.evals.runner import RunConfig, run_eval

    off = {"thinking": False}
    config = RunConfig(tasks=("niah",), lengths=(768,), depths=(0.0, 100.0), chat=True, concurrency=2,
                       executor="threads")
    args = {"model": {"model": tiny_checkpoint}, "engine": {"max_model_len": 2048, "cache_memory_mb": 32}}
    engine, _ = build_engine(ServeArgs.model_validate(args).resolved())
    targets = {"served": OpenAITarget(server, MODEL, chat_template_kwargs=off),
               "local": EngineTarget(engine, chat_template_kwargs=off)}
    records = {}
    for name, target in targets.items():
        assert run_eval(config, target, tmp_path / name, progress=False)["errors"] == 0
        lines = (tmp_path / name / "results.jsonl").read_text().splitlines()
        records[name] = sorted((r["prompt_sha256"], r["prompt_tokens"], r["prediction"])
                               for r in map(json.loads, lines))
    assert {tokens for _, tokens, _ in records["served"]} == {768}
    assert any(prediction for *_, prediction in records["served"])  # thinking off: the answer is content
    assert not any(m in p for *_, p in records["served"] for m in MARKUP)
    assert records["served"] == records["local"]
