"""The OpenAPI document's 200 answers of /v1/messages (the message and its event stream) and
/v1/messages/count_tokens, and its x-api-key scheme."""

from __future__ import annotations

_TEXT = {"type": "string"}
_COUNT = {"type": "integer", "minimum": 0}
_THINKING = {"type": "object", "required": ["type", "thinking", "signature"], "properties": {
    "type": {"const": "thinking"}, "thinking": _TEXT, "signature": {"type": "string", "description": "empty: "
                                                                                     "K3's thinking is not signed"}}}
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": _TEXT}}
_TOOL_USE = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
    "type": {"const": "tool_use"}, "id": {"type": "string", "description": "functions.NAME:INDEX, as the model "
                                                                            "wrote it"},
    "name": _TEXT, "input": {"type": "object"}}}

MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
    "properties": {
        "id": _TEXT, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _TEXT,
        "content": {"type": "array", "description": "thinking, then text, then tool_use blocks",
                    "items": {"oneOf": [_THINKING, _TEXT_BLOCK, _TOOL_USE]}},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": ["string", "null"]},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                  "properties": {"input_tokens": _COUNT, "output_tokens": _COUNT}},
    },
}
MESSAGE_EVENTS = {"schema": {  # one server-sent event (OpenAPI 3.1 has no itemSchema yet)
    "type": "object", "required": ["event", "data"], "properties": {
        "event": {"type": "string", "description": "the event's type: message_start, then per content block "
                                                   "content_block_start, content_block_delta (thinking_delta, "
                                                   "text_delta, input_json_delta), content_block_stop, then "
                                                   "message_delta and message_stop; error if the stream fails"},
        "data": {"type": "string", "description": "the event as JSON, its type included"}}}}
INPUT_TOKENS = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": _COUNT}}
X_API_KEY = {"type": "apiKey", "in": "header", "name": "x-api-key"}  # Anthropic's header, beside the bearer
