"""The OpenAPI document of the OpenAI app, made to say what the server does.

    app.openapi = functools.partial(openapi_document, app, ServerLimits(...))

FastAPI documents a 422 and a JSON 200 for every route; here a failed validation is a 400, every route
lists its errors with the OpenAI error body (/v1/messages with Anthropic's), the 200 bodies have their
schemas, /health and /metrics answer text, completions also stream (text/event-stream), an API key
shows as a bearer scheme (/v1/messages also as x-api-key), and
the limits that are this server's own (its model name, vocabulary, context, whether it takes media)
are written where openai_protocol marks them, so that a request the document calls valid is served
and one it calls invalid is a 4xx (tests/actors/test_serve_schemathesis.py holds it to that).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST

from k3ray.actors.openai.messages_errors import is_messages_path
from k3ray.actors.openai.messages_schema import INPUT_TOKENS, MESSAGE, MESSAGE_EVENTS, X_API_KEY
from k3ray.actors.openai.middleware import OPEN_PATHS
from k3ray.actors.openai.protocol import LIMIT
from k3ray.actors.openai.responses_schema import RESPONSE, RESPONSE_EVENTS

STREAMING_PATHS = ("/v1/completions", "/v1/chat/completions")
_TEXT_OK = {"description": "healthy: `ok`", "content": {"text/plain": {"schema": {"type": "string"}}}}
_TEXT_ANSWERS = {  # the 200s that are no JSON
    "/health": _TEXT_OK, "/ready": _TEXT_OK,
    "/metrics": {"description": "Prometheus text exposition format",
                 "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
}
_NULLABLE_OBJECT = {"type": ["object", "null"]}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"finish_reason": {"type": ["string", "null"]}, "stop_reason": {"type": ["string", "integer", "null"]}}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string", "description": "functions.NAME:INDEX, as the model wrote it"},
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}}}}}
_MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}


def _answer(object_name: str, choice: dict) -> dict:
    """A completion or chat completion body."""
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": object_name}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": _USAGE,
        "choices": {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"],
                                               "properties": {"index": {"type": "integer"}, **choice, **_FINISH}}}}}


_JSON_ANSWERS = {  # the 200 bodies (FastAPI knows them only as `dict`)
    "/v1/models": {"type": "object", "required": ["object", "data"],
                   "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL_CARD}}},
    "/v1/models/{model}": _MODEL_CARD,
    "/v1/completions": _answer("text_completion", {"text": {"type": "string"}, "logprobs": _NULLABLE_OBJECT}),
    "/v1/chat/completions": _answer("chat.completion", {"logprobs": _NULLABLE_OBJECT, "message": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                       "tool_calls": {"type": "array", "items": _TOOL_CALL}}}}),
    "/tokenize": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
        "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}},
    "/detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "/v1/responses": RESPONSE,
    "/v1/messages": MESSAGE,
    "/v1/messages/count_tokens": INPUT_TOKENS,
}
_EVENT_STREAM = {"schema": {  # one server-sent event (OpenAPI 3.1 has no itemSchema yet)
    "type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": "a JSON chunk, or an OpenAI error body if the stream fails; "
                                         "the last event is `[DONE]`"}}}}


@dataclass(frozen=True)
class ServerLimits:
    model_name: str
    vocab_size: int
    max_model_len: int
    supports_media: bool
    api_key: bool
    media_schemes: tuple[str, ...] = ("data",)  # + http(s) with remote media URLs, file with a local folder


def openapi_document(app: FastAPI, limits: ServerLimits) -> dict:
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, methods in doc["paths"].items():
            for operation in methods.values():
                operation["responses"].pop("422", None)  # a request that fails validation gets a 400
                if limits.api_key and path not in OPEN_PATHS:
                    operation["security"] = [{"bearer": []}, *([{"x-api-key": []}] if is_messages_path(path) else [])]
                else:  # no key asked for here: never a 401
                    operation["responses"].pop("401", None)
        for path, answer in _TEXT_ANSWERS.items():
            doc["paths"][path]["get"]["responses"]["200"] = answer
        for path, answer in _JSON_ANSWERS.items():
            (operation,) = doc["paths"][path].values()
            operation["responses"]["200"]["content"]["application/json"]["schema"] = answer
        for path in STREAMING_PATHS:
            doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"] = _EVENT_STREAM
        doc["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"] = RESPONSE_EVENTS
        doc["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]["text/event-stream"] = MESSAGE_EVENTS
        components = doc.setdefault("components", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(unused, None)
        if limits.api_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}, "x-api-key": X_API_KEY}
        app.openapi_schema = fill_in_limits(doc, limits)
    return app.openapi_schema


def fill_in_limits(node, limits: ServerLimits, media_refs: frozenset[str] | None = None):
    """`node` with each LIMIT mark replaced by the bound it names (media parts dropped from a model
    that has no vision tower, inline or as a reference to a marked component)."""
    if media_refs is None:
        components = node.get("components", {}).get("schemas", {}) if isinstance(node, dict) else {}
        media_refs = frozenset(f"#/components/schemas/{name}" for name, schema in components.items()
                               if isinstance(schema, dict) and schema.get(LIMIT) == "media")
    if isinstance(node, list):
        return [fill_in_limits(item, limits, media_refs) for item in node
                if limits.supports_media or not _is_media(item, media_refs)]
    if not isinstance(node, dict):
        return node
    node = {key: fill_in_limits(value, limits, media_refs) for key, value in node.items()}
    kind = node.pop(LIMIT, None)
    if kind == "served_model":
        _on_branch(node, "string")["enum"] = [limits.model_name]
    elif kind == "vocab":
        _on_branch(node, "integer")["maximum"] = limits.vocab_size - 1
    elif kind == "context":
        _on_branch(node, "integer")["maximum"] = limits.max_model_len - 1
    elif kind == "media_url":
        node["pattern"] = f"^(?:{'|'.join(limits.media_schemes)}):"
    elif kind == "vocab_keys":
        _on_branch(node, "object")["propertyNames"] = {"pattern": f"^0*(?:{below_pattern(limits.vocab_size)})$"}
    return node


def _is_media(item, media_refs: frozenset[str]) -> bool:
    return isinstance(item, dict) and (item.get(LIMIT) == "media" or item.get("$ref") in media_refs)


def _on_branch(node: dict, json_type: str) -> dict:
    """The schema of `node` for values of `json_type`: itself, or its anyOf branch of that type."""
    if node.get("type") == json_type:
        return node
    (branch,) = (b for b in node.get("anyOf", ()) if b.get("type") == json_type)
    return branch


def below_pattern(limit: int) -> str:
    """A regular expression for the decimal integers in [0, limit) without leading zeros."""
    assert limit >= 1
    top = str(limit - 1)
    if len(top) == 1:
        return f"[0-{top}]"
    alternatives = ["[0-9]"] + [f"[1-9][0-9]{{{digits - 1}}}" for digits in range(2, len(top))]
    for i, digit in enumerate(top):  # as many digits as top, the first smaller digit at i
        low = 1 if i == 0 else 0
        if int(digit) > low:
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + "[0-9]" * (len(top) - i - 1))
    return "|".join([*alternatives, top])
