"""A tool's parameters schema is checked once in the server on its way to the grammar: in the tool plan
when it is only declared (tool_choice auto / none, or a tool another named choice leaves out), else with
the call grammar it is part of (required / named), so a schema the grammar engine refuses is a 400 before
any stream. (The engine checks what it is handed at its own boundary, in its own process.)"""

import json

import pytest

from k3ray import strict_json
from k3ray.actors.openai.protocol import ChatCompletionRequest
from k3ray.actors.openai.serving import OpenAIServing
from k3ray.actors.openai.tools import tool_plan
from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import build_engine
from k3ray.engine.async_engine import AsyncEngine

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]+$"}}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def serving(tiny_checkpoint):
    args = ServeArgs.model_validate({"model": {"model": tiny_checkpoint},
                                     "engine": {"max_model_len": 160, "cache_memory_mb": 16}}).resolved()
    engine, _ = build_engine(args)
    yield OpenAIServing(AsyncEngine(engine), engine.tokenizer, "k3-tools")
    engine.close()


@pytest.fixture
def checked(monkeypatch) -> list[str]:
    """The schema texts the checks read, in order."""
    seen, real = [], strict_json._checked_schema
    monkeypatch.setattr(strict_json, "_checked_schema",
                        lambda text, max_bytes: seen.append(text) or real(text, max_bytes))
    return seen


@pytest.mark.parametrize("tool_choice, compiled", [
    ("auto", []), ("none", []), ("required", ["weather", "clock"]),
    ({"type": "function", "function": {"name": "clock"}}, ["clock"]),
])
def test_each_schema_is_checked_once_in_the_server(serving, checked, tool_choice, compiled):
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tool_choice": tool_choice,
        "tools": [tool("weather", WEATHER), tool("clock", CLOCK)]})
    plan = tool_plan(req, serving.tokenizer, serving.info.max_schema_bytes)
    params = serving.sampling_params(req, max_tokens=8, logprobs=None, tools=plan, thinking=True)
    texts = {json.dumps(s, separators=(",", ":")): name for name, s in (("weather", WEATHER), ("clock", CLOCK))}
    assert sorted(texts[t] for t in checked) == ["clock", "weather"]  # each once, none twice
    grammar = params.structured_outputs
    assert ([name for name, _ in grammar.tool_calls.functions] if grammar else []) == compiled
