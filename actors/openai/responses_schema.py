"""The OpenAPI document's 200 answers of /v1/responses: the Response body and its event stream."""

from __future__ import annotations

_TEXT = {"type": "string"}
_ITEM_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_REASONING = {"type": "object", "required": ["type", "id", "summary"], "properties": {
    "type": {"const": "reasoning"}, "id": _TEXT, "summary": {"type": "array"}, "status": _ITEM_STATUS,
    "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "reasoning_text"}, "text": _TEXT}}}}}
_MESSAGE = {"type": "object", "required": ["type", "id", "role", "status", "content"], "properties": {
    "type": {"const": "message"}, "id": _TEXT, "role": {"const": "assistant"}, "status": _ITEM_STATUS,
    "content": {"type": "array", "items": {"type": "object", "required": ["type", "text", "annotations"],
                                           "properties": {"type": {"const": "output_text"}, "text": _TEXT,
                                                          "annotations": {"type": "array"}}}}}}
_FUNCTION_CALL = {"type": "object", "required": ["type", "id", "call_id", "name", "arguments"], "properties": {
    "type": {"const": "function_call"}, "id": _TEXT, "call_id": _TEXT, "name": _TEXT, "status": _ITEM_STATUS,
    "arguments": {"type": "string", "description": "JSON text"}}}
_COUNT = {"type": "integer", "minimum": 0}
_USAGE = {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"], "properties": {
    "input_tokens": _COUNT, "output_tokens": _COUNT, "total_tokens": _COUNT,
    "input_tokens_details": {"type": "object", "properties": {"cached_tokens": _COUNT}},
    "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": _COUNT}}}}

RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created_at", "status", "model", "output", "tools", "tool_choice",
                 "parallel_tool_calls", "usage"],
    "properties": {
        "id": _TEXT, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete"]}, "model": _TEXT,
        "output": {"type": "array", "items": {"oneOf": [_REASONING, _MESSAGE, _FUNCTION_CALL]}},
        "incomplete_details": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "reason": {"const": "max_output_tokens"}}}]},
        "usage": _USAGE, "tools": {"type": "array"}, "parallel_tool_calls": {"type": "boolean"},
        "store": {"const": False, "description": "nothing is stored"},
    },
}
RESPONSE_EVENTS = {"schema": {  # one server-sent event (OpenAPI 3.1 has no itemSchema yet)
    "type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string", "description": "the event's type: response.created, ..., response.completed "
                                                   "(response.incomplete at max_output_tokens); error then "
                                                   "response.failed if the stream fails"},
        "data": {"type": "string", "description": "the event as JSON: its type, sequence_number and fields"}}}}
