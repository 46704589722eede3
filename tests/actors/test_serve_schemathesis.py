"""Schemathesis over the live Serve app's OpenAPI document, with all its checks.

Requests the document calls valid (positive) must be served with a 2xx, requests it calls invalid
(negative) must get a 4xx, and every answer must match its documented status, content type, headers
and body schema; an API key is a bearer scheme that the app must not ignore. The rules between fields
that JSON Schema can state (stream_options only with stream, top_logprobs above 0 only with logprobs,
...) are in the document, so a positive request never breaks them; the few beyond it (the context
limit, best_of >= n, a schema the grammar engine compiles, ...) are in its descriptions, a positive
request that breaks one must get a 400 with the OpenAI error body instead, and `broken_rule` names
which rule it broke.
The model is the tiny K3 without a vision tower (its document has no media parts) and a small context,
so that generated requests are cheap; examples are bounded (EXAMPLES per operation and mode).
Cases come from schemathesis's fuzzing phase (`as_strategy`): its pytest loader for a fixture's schema
reads `request.node._nodeid`, which pytest 9 no longer has, and its coverage phase (the only one where
`unsupported_method` acts) is reached only through that loader or its CLI, so
test_an_undocumented_method_is_405_with_allow asks what that check asks.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from k3ray.actors.openai.errors import APIError
from k3ray.actors.openai.messages import chat_request as messages_chat_request
from k3ray.actors.openai.messages_protocol import CountTokensRequest, MessagesRequest
from k3ray.actors.openai.protocol import MAX_SEQUENCES_PER_REQUEST, CompletionRequest
from k3ray.actors.openai.responses_convert import chat_request
from k3ray.actors.openai.responses_protocol import ResponsesRequest
from k3ray.actors.openai.tools import NO_PARAMETERS
from k3ray.engine.structured.structured_output import check_grammar
from k3ray.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.timeout(900)
MODEL = "k3-schema"
KEY = "schema-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 96  # the chat template's system prompt alone is about 70 tokens
EXAMPLES = 25
DEFAULT_MAX_TOKENS = CompletionRequest.model_fields["max_tokens"].default
CONFIG = {
    "checks": {"positive_data_acceptance": {"expected-statuses": ["2xx"]}},
    "auth": {"openapi": {"bearer": {"bearer": KEY}}},
}


@pytest.fixture(scope="module")
def server(serve_app, echo_checkpoint):
    return serve_app({
        "model": {"model": echo_checkpoint},
        "server": {"served_model_name": MODEL, "api_key": KEY, "max_body_bytes": 64 * 1024},
        "engine": {"max_model_len": MAX_MODEL_LEN, "cache_memory_mb": 32, "max_num_seqs": 32},
    })


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server}/openapi.json", headers=AUTH,
                                         config=schemathesis.Config.from_dict(CONFIG))


def test_the_server_does_what_its_openapi_document_says(api_schema, server):
    """Every operation, positive and negative; all failures are reported together."""
    failures = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzz(operation, mode, server)
            except Unsatisfiable:  # nothing to make invalid: no parameters, no body
                assert mode == GenerationMode.NEGATIVE, operation.label
            except (AssertionError, BaseExceptionGroup) as e:
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)


def fuzz(operation, mode: GenerationMode, server: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        rule = broken_rule(case, server) if mode == GenerationMode.POSITIVE else None
        if rule is None:
            case.call_and_validate(timeout=120)
            return
        response = case.call_and_validate(timeout=120, excluded_checks=[positive_data_acceptance])
        assert response.status_code == 400, (rule, response.status_code, response.text[:300])

    run()


def broken_rule(case, server: str) -> str | None:
    """The rule between fields (stated in the document's descriptions) that a schema-valid body breaks."""
    body = case.body if isinstance(case.body, dict) else {}
    route = case.operation.path
    if route == "/tokenize":
        return _continue_rule(body) if body.get("messages") is not None else None
    if route == "/v1/responses":
        return _responses_rule(body, server)
    if route in ("/v1/messages", "/v1/messages/count_tokens"):
        return _messages_rule(body, server, route == "/v1/messages")
    if route not in ("/v1/completions", "/v1/chat/completions"):
        return None
    rule = _grammar_rule(body)
    if rule is not None:
        return rule
    if route == "/v1/chat/completions":
        rule = _continue_rule(body) or _tools_rule(body)
        if rule is not None:
            return rule
        max_tokens = body.get("max_completion_tokens")
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        prompt = {k: body[k] for k in ("messages", "add_generation_prompt", "continue_final_message", "tools")
                  if k in body}
        return _context_rule(server, [prompt], max_tokens)
    n, best_of = body.get("n", 1), body.get("best_of")
    if best_of is not None and best_of < n:
        return "best_of >= n"
    if best_of is not None and best_of > n and body.get("stream"):
        return "best_of > n is not streamed"
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    prompts = _prompts(body["prompt"])
    if len(prompts) * (best_of or n) > MAX_SEQUENCES_PER_REQUEST:
        return "prompts x samples <= MAX_SEQUENCES_PER_REQUEST"
    return _context_rule(server, prompts, 1 if max_tokens == 0 else max_tokens)


def _prompts(prompt) -> list:
    if isinstance(prompt, str) or all(isinstance(t, (int, float)) for t in prompt):  # 2.0 is a token id
        return [prompt]
    return prompt


def _continue_rule(body: dict) -> str | None:
    if body.get("continue_final_message") and body["messages"][-1].get("role") != "assistant":
        return "continue_final_message needs a final assistant message"
    return None


def _grammar_rule(body: dict) -> str | None:
    response_format = body.get("response_format") or {"type": "text"}
    if response_format["type"] == "json_schema":
        try:
            check_grammar(StructuredOutputsParams(json=response_format["json_schema"]["schema"]))
        except ValueError:
            return "a JSON schema the grammar engine compiles"
    return None


def _tools_rule(body: dict) -> str | None:
    tools = body.get("tools") or []
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        return "function names are unique"
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        return "a named tool_choice names one of tools"
    for t in tools:
        try:
            check_grammar(StructuredOutputsParams(json=t["function"].get("parameters") or NO_PARAMETERS))
        except ValueError:
            return "each tool's parameters compile as a grammar"
    return None


def _responses_rule(body: dict, server: str) -> str | None:
    """The chat request's rules (a Responses request is served as one), after the input's own: it must
    have a message, and each function_call_output answer an earlier function_call."""
    try:
        chat = chat_request(ResponsesRequest.model_validate(body)).model_dump(by_alias=True, exclude_none=True)
    except APIError as e:
        return f"the input renders as a chat: {e.message}"
    prompt = {k: chat[k] for k in ("messages", "tools") if k in chat}
    return _grammar_rule(chat) or _tools_rule(chat) or _context_rule(server, [prompt], chat.get("max_tokens"))


def _messages_rule(body: dict, server: str, generates: bool) -> str | None:
    """The chat request's rules (a Messages request is served as one), after the messages' own (each
    tool_result answers a tool_use of the assistant message before it); the context as count_tokens,
    which renders the same prompt, counts it."""
    try:
        request = (MessagesRequest if generates else CountTokensRequest).model_validate(body)
        chat = messages_chat_request(request).model_dump(by_alias=True, exclude_none=True)
    except APIError as e:
        return f"the messages render as a chat: {e.message}"
    rule = _tools_rule(chat)
    if rule is not None:
        return rule
    counted = httpx.post(f"{server}/v1/messages/count_tokens", json=body, headers=AUTH, timeout=60)
    if counted.status_code == 400 and "maximum context length" in counted.json()["error"]["message"]:
        return "prompt tokens < max_model_len"
    if counted.status_code != 200:
        return None  # the request itself shows what the document missed
    if generates and counted.json()["input_tokens"] + body["max_tokens"] > MAX_MODEL_LEN:
        return "prompt tokens + max_tokens <= max_model_len"
    return None


def _context_rule(server: str, prompts: list, max_tokens: int | None) -> str | None:
    """Each prompt's tokens (as the server's /tokenize counts them) plus max_tokens fit the context."""
    for prompt in prompts:
        if isinstance(prompt, list):
            count = len(prompt)
        else:
            request = {"prompt": prompt} if isinstance(prompt, str) else prompt
            answer = httpx.post(f"{server}/tokenize", json=request, headers=AUTH, timeout=60)
            if answer.status_code != 200:
                return None  # the request itself shows what the document missed
            count = answer.json()["count"]
        if count >= MAX_MODEL_LEN or count + (max_tokens or 0) > MAX_MODEL_LEN:
            return "prompt tokens + max_tokens <= max_model_len"
    return None


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


def error_param(response: httpx.Response) -> str | None:
    assert response.status_code == 400, response.text
    return response.json()["error"]["param"]


# what schemathesis found, one request each
def test_an_integral_float_is_an_integer(http):
    """JSON Schema's integer is a number with no fraction: 2.0 is one, 2.5, `true` and "2" are not."""
    ok = http.post("/v1/completions", json={"prompt": [35, 299.0], "max_tokens": 2.0, "n": 1.0})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 1
    for bad in (2.5, True, "2"):
        assert error_param(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": bad})) == "max_tokens"


def test_tokenize_messages_on_a_model_without_a_vision_tower(http):
    answer = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text  # was a 500: no media settings to look up
    assert answer.json()["count"] > 2


@pytest.mark.parametrize("message", [
    {"role": "user", "content": [{"type": ["text"], "text": "x"}]},  # was a 500: a list is no dict key
    {"role": "user", "content": [{"text": "x"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": ["x"], "function": {"name": "f"}}]},
    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": 3}}]},
])
def test_malformed_message_parts_are_400(http, message):
    for route in ("/v1/chat/completions", "/tokenize"):
        assert error_param(http.post(route, json={"messages": [message]})).startswith("messages[0]")


def test_event_streams_are_documented(http):
    paths = http.get("/openapi.json").json()["paths"]
    for route in ("/v1/completions", "/v1/chat/completions"):
        content = paths[route]["post"]["responses"]["200"]["content"]
        assert content["text/event-stream"]["schema"]["required"] == ["data"]
    assert paths["/v1/models"]["get"]["security"] == [{"bearer": []}] and "security" not in paths["/health"]["get"]


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 2.5}, "temperature"), ({"logit_bias": {"+7": 1}}, "logit_bias"),
    ({"logit_bias": {" 7": 1}}, "logit_bias"), ({"suffix": "x"}, "suffix"), ({"top_k": -2}, "top_k"),
])
def test_values_beyond_the_documented_bounds_are_400(http, fields, param):
    assert error_param(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **fields})) == param


def test_an_undocumented_method_is_405_with_allow(http):
    """What schemathesis's unsupported_method check asks (it runs only in its coverage phase)."""
    paths = http.get("/openapi.json").json()["paths"]
    for path, operations in paths.items():
        path = path.replace("{model}", MODEL)
        method = "DELETE" if "delete" not in operations else "PATCH"
        answer = http.request(method, path)
        assert answer.status_code == 405, (method, path, answer.text)
        assert {m.strip().lower() for m in answer.headers["allow"].split(",")} >= set(operations) - {"head"}
        fields = {"message", "type"} if path.startswith("/v1/messages") else {"message", "type", "param", "code"}
        assert set(answer.json()["error"]) == fields, (path, answer.text)


# every bound of the document, at and past it: the document's verdict on the body is the server's
BOUND_BASES = {  # small valid bodies the swept field is set on (a 1-token prompt leaves max_tokens its range)
    "/v1/completions": [{"prompt": [104], "max_tokens": 1}],
    "/v1/chat/completions": [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True}],
    "/tokenize": [{"prompt": "hi"}],
    "/detokenize": [{"tokens": [104]}],
    "/v1/responses": [{"input": "hi", "max_output_tokens": 1}],
    "/v1/messages": [{"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}],
}


def bound_values(schema: dict) -> list:
    """Values at and just past each bound a property's schema (or one of its anyOf branches) has."""
    values = []
    for branch in [schema, *schema.get("anyOf", ())]:
        kind = branch.get("type")
        if kind in ("integer", "number"):
            step = 1 if kind == "integer" else 0.01
            for key, inside, outside in (("minimum", 0, -step), ("maximum", 0, step),
                                         ("exclusiveMinimum", step, 0), ("exclusiveMaximum", -step, 0)):
                if key in branch:
                    values += [type(step)(branch[key] + shift) for shift in (inside, outside)]
        elif kind == "string":
            for key, past in (("minLength", -1), ("maxLength", 1)):
                if key in branch:
                    values += ["x" * n for n in (branch[key], branch[key] + past) if n >= 0]
        elif kind == "array":
            values += [[v] for v in bound_values(branch.get("items", {}))]
        elif kind == "object":
            for value_schema in branch.get("patternProperties", {}).values():
                values += [{"7": v} for v in bound_values(value_schema)]
    return values


def test_every_bound_of_the_document_is_the_servers(http):
    """Each numeric and length bound of each request body, at its edge and one step past it, alone and
    with the bodies' rules between fields: a body the document calls valid is served (or, in chat, meets
    the context limit it describes), one it calls invalid is a 400 naming the field."""
    import jsonschema

    document = http.get("/openapi.json").json()
    checked = 0
    for route, bases in BOUND_BASES.items():
        (operation,) = document["paths"][route].values()
        body_schema = operation["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator({**body_schema, "components": document["components"]})
        name = body_schema["$ref"].rsplit("/", 1)[-1]
        for field, schema in document["components"]["schemas"][name]["properties"].items():
            for value in bound_values(schema):
                for base in bases:
                    body = {**base, field: value}
                    answer = http.post(route, json=body)
                    checked += 1
                    if validator.is_valid(body):
                        error = answer.json().get("error") if answer.status_code == 400 else None
                        over_context = route in ("/v1/chat/completions", "/v1/responses", "/v1/messages") and \
                            error is not None and (error.get("code") == "context_length_exceeded" or
                                                   "maximum context length" in error["message"])
                        assert answer.status_code == 200 or over_context, (route, body, answer.text[:300])
                    else:
                        assert answer.status_code == 400, (route, body, answer.text[:300])
                        error = answer.json()["error"]  # Anthropic's names no param: its message does
                        assert field in (error.get("param") or error["message"]), (route, body, answer.text[:300])
    assert checked > 100
