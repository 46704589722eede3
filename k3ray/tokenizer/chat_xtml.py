"""Kimi K3's chat encoding, XTML, as plain Python: OpenAI-style messages -> control and text segments.

K3's release tokenizer renders chats in Python (its `chat_template` is None); this follows the
format facts of its encoder (docs/k3-conversation.md has them with their public
sources). An element is `<|open|>NAME ATTRS<|sep|>BODY<|close|>NAME<|sep|>`, attributes are
` key="value"` with `&` and `"` escaped, and each top-level message is followed by `<|end_of_msg|>`:

    [tool-declare]  <|open|>message role="system" type="tool-declare"<|sep|># Tools ...json...<|close|>message<|sep|><|end_of_msg|>
    [effort]        <|open|>message role="system" type="thinking-effort"<|sep|>...<|close|>message<|sep|><|end_of_msg|>
    messages        <|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>
                    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>R<|close|>think<|sep|>
                        <|open|>response<|sep|>C<|close|>response<|sep|>
                        <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
                            <|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|>
                        <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
                    <|open|>message role="tool" tool="f" index="1"<|sep|>18C<|close|>message<|sep|><|end_of_msg|>
    [tool-choice]   required / none: a system message saying what the next message must do
    [response fmt]  json_object / json_schema: a system message with the schema
    generation      <|open|>message role="assistant"<|sep|><|open|>think<|sep|>   (thinking off: ...<|open|>response<|sep|>)

There is no default system prompt. With thinking on, every assistant turn of the history has its
think channel (its `reasoning_content`, empty if none); with it off none has. Tool results are put in
the order of the calls they answer (matched by tool_call_id) and named after them. Each segment is
encoded on its own (token boundaries as the release tokenizer has them); message text never becomes
a special token. Beyond the release: `developer` is `system`, and `continue_final_message` leaves the
final assistant message's last channel open.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from k3ray.tokenizer import special as sp
from k3ray.tokenizer.chat import ChatSegment, check_messages, content_segments, deep_sorted
from k3ray.tokenizer.chat_options import ChatOptions

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={effort}`.")
TOOL_CHOICE_TEXT = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
RAW_JSON_TEXT = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
                 "formatting.")


def render_xtml_chat(
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[dict] | None = None,
    options: ChatOptions = ChatOptions(),
    media_prompt: Callable[[str], list[ChatSegment]] | None = None,
) -> list[ChatSegment]:
    """Render a conversation in XTML (module docstring); ValueError naming the problem on bad input.
    media_prompt: an image or video item's segments by its kind (default `media_item`)."""
    media_prompt = media_prompt or media_item
    _check(messages, continue_final_message)
    thinking = options.thinking_on()
    out: list[ChatSegment] = []
    if tools:
        body = TOOLS_HEADER + _compact_json(tools) + "\n```"
        out += _system_message("tool-declare", body)
    if thinking and options.effort() is not None:
        out += _system_message("thinking-effort", EFFORT_TEXT.format(effort=options.effort()))
    ordered = _tool_results_in_call_order(messages)
    last_assistant_calls: list = []
    tool_position = 0
    for index, message in enumerate(ordered):
        where = f"messages[{message['_index']}]"
        role = "system" if message["role"] == "developer" else message["role"]
        is_open = continue_final_message and index == len(ordered) - 1
        if role == "assistant":
            last_assistant_calls = message.get("tool_calls") or []
            tool_position = 0
            out += _assistant(message, where, thinking, is_open, media_prompt)
            continue
        attrs = {"role": role}
        if role == "tool":
            tool_position += 1
            attrs["tool"] = _tool_name(message, last_assistant_calls, tool_position, where)
            attrs["index"] = str(tool_position)
        elif message.get("name"):
            attrs["name"] = message["name"]
        out += _open("message", attrs) + content_segments(message.get("content"), f"{where}.content", media_prompt)
        out += _close("message") + [_control(sp.END_OF_MSG)]
    choice = options.tool_choice_mode()
    if choice in TOOL_CHOICE_TEXT:
        out += _system_message("tool-choice", TOOL_CHOICE_TEXT[choice])
    out += _response_format(options.response_format)
    if add_generation_prompt and not continue_final_message:
        out += _open("message", {"role": "assistant"}) + _open("think" if thinking else "response", {})
    return [segment for segment in out if segment.text]


def media_item(kind: str, begin: str = sp.MEDIA_BEGIN, placeholder: str = sp.MEDIA_PAD) -> list[ChatSegment]:
    """One media item as K3's processor writes its prompt, `<|media_begin|>image<|media_content|><|media_pad|>
    <|media_end|>`, with one placeholder the vision path expands to the item's embeddings."""
    return [_control(begin), _text(kind), _control(sp.MEDIA_CONTENT), _control(placeholder), _control(sp.MEDIA_END)]


def escape_attribute(value: str) -> str:
    """An attribute value as XTML writes it (`&` first, so an escape is never escaped twice)."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def argument_type(value: Any) -> str:
    """The `type` attribute of a typed argument element for a JSON value."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _check(messages: Sequence[dict], continue_final_message: bool) -> None:
    check_messages(messages, ROLES)
    for index, message in enumerate(messages):
        if message["role"] in ("system", "developer", "user", "tool") and message.get("content") is None:
            raise ValueError(f"messages[{index}] (role {message['role']!r}) has no content")
    if continue_final_message:
        last = messages[-1]
        if last["role"] != "assistant":
            raise ValueError(f"continue_final_message=True needs a final assistant message, got role {last['role']!r}")
        if last.get("tool_calls"):
            raise ValueError("continue_final_message=True cannot continue an assistant message with tool_calls: "
                             "its tools channel is closed")


def _tool_results_in_call_order(messages: Sequence[dict]) -> list[dict]:
    """Copies of messages (with `_index`, their place in the request); each run of tool results whose
    every tool_call_id matches a call of the assistant before it is put in call order and named after
    its call, as the release encoder does; a run with an unmatched id is left as sent."""
    out: list[dict] = []
    calls: dict[str, tuple[int, str]] = {}  # call id -> (1-based position, function name)
    run: list[dict] = []

    def flush() -> None:
        matched = [calls.get(str(m.get("tool_call_id"))) for m in run]
        if run and all(matched):
            order = sorted(range(len(run)), key=lambda i: (matched[i][0], i))
            out.extend({**run[i], "tool": matched[i][1]} for i in order)
        else:
            out.extend(run)
        run.clear()

    for index, message in enumerate(messages):
        message = {**message, "_index": index}
        if message["role"] == "tool":
            run.append(message)
            continue
        flush()
        if message["role"] == "assistant":
            calls = {}
            for position, call in enumerate(message.get("tool_calls") or [], start=1):
                call_id = call.get("id") if isinstance(call, dict) else None
                if call_id is not None and str(call_id) not in calls:
                    calls[str(call_id)] = (position, _function(call, "")["name"])
        out.append(message)
    flush()
    return out


def _tool_name(message: dict, calls: list, position: int, where: str) -> str:
    name = message.get("tool") or message.get("name")
    if not name and position <= len(calls):
        name = _function(calls[position - 1], where)["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} (role 'tool') answers no tool call: give a tool_call_id that matches one of the "
                         "previous assistant message's tool_calls, or a name")
    return name


def _assistant(message: dict, where: str, thinking: bool, is_open: bool, media_prompt: Callable
               ) -> list[ChatSegment]:
    attrs = {"role": "assistant", **({"name": message["name"]} if message.get("name") else {})}
    out = _open("message", attrs)
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}.reasoning_content must be a string, got {type(reasoning).__name__}")
    content = message.get("content")
    calls = message.get("tool_calls")
    if thinking:
        out += _open("think", {}) + ([_text(reasoning)] if reasoning and reasoning.strip() else [])
        if is_open and not content:  # continue inside the reasoning
            return out
        out += _close("think")
    out += _open("response", {})
    if content is not None:
        out += content_segments(content, f"{where}.content", media_prompt)
    if is_open:
        return out
    out += _close("response")
    if calls:
        out += _tool_calls(calls, f"{where}.tool_calls")
    return out + _close("message") + [_control(sp.END_OF_MSG)]


def _tool_calls(calls: Any, where: str) -> list[ChatSegment]:
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list, got {type(calls).__name__}")
    out = _open("tools", {})
    for position, call in enumerate(calls, start=1):
        function = _function(call, f"{where}[{position - 1}]")
        out += _open("call", {"tool": function["name"], "index": str(position)})
        out += _arguments(function.get("arguments"), f"{where}[{position - 1}].function.arguments")
        out += _close("call")
    return out + _close("tools")


def _function(call: Any, where: str) -> dict:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} needs a 'function' dict with a string 'name'")
    return function


def _arguments(arguments: Any, where: str) -> list[ChatSegment]:
    """Typed argument elements for a JSON object; text that is no JSON as the raw json block."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return []
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return _open("json", {"type": "object"}) + [_text(arguments)] + _close("json")
    if not isinstance(arguments, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(arguments).__name__}")
    out: list[ChatSegment] = []
    for key, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        out += _open("argument", {"key": str(key), "type": argument_type(value)}) + [_text(text)] + _close("argument")
    return out


def _response_format(response_format: Mapping | None) -> list[ChatSegment]:
    kind = response_format.get("type") if response_format else None
    if kind == "json_object":
        return _system_message("response-format", "The system is invoked with `response_format=json_object`.\n"
                               + RAW_JSON_TEXT)
    if kind != "json_schema":
        return []
    holder = response_format.get("json_schema")  # none: the release prints `null`
    schema = holder.get("schema", holder.get("json_schema", holder)) if isinstance(holder, dict) else None
    return _system_message("response-format", "The system is invoked with `response_format=json_schema`.\n"
                           + RAW_JSON_TEXT + "\nThe JSON data must match the following schema:\n```json\n"
                           + _compact_json(schema) + "\n```")


def _system_message(kind: str, body: str) -> list[ChatSegment]:
    return _open("message", {"role": "system", "type": kind}) + [_text(body.strip())] + _close("message") + \
        [_control(sp.END_OF_MSG)]


def _compact_json(value: Any) -> str:
    return json.dumps(deep_sorted(value), ensure_ascii=False, separators=(",", ":"))


def _open(tag: str, attrs: Mapping[str, str]) -> list[ChatSegment]:
    """As the release encoder segments it: each attribute's key, `="`, value and `"` apart."""
    out = [_control(sp.OPEN), _text(tag)]
    for key, value in attrs.items():
        out += [_text(f" {key}"), _text('="'), _text(escape_attribute(value)), _text('"')]
    return out + [_control(sp.SEP)]


def _close(tag: str) -> list[ChatSegment]:
    return [_control(sp.CLOSE), _text(tag), _control(sp.SEP)]


def _control(text: str) -> ChatSegment:
    return ChatSegment(text, True)


def _text(text: str) -> ChatSegment:
    return ChatSegment(text, False)
