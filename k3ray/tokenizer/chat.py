"""Kimi's chat format as plain Python: OpenAI-style messages -> text and control segments.

The layout follows Kimi K2's published `chat_template.jinja`:

    <|im_system|>tool_declare<|im_middle|>{tools as compact JSON}<|im_end|>     only with tools
    <|im_system|>system<|im_middle|>You are Kimi, ...<|im_end|>                 if messages[0] is not a system message
    <|im_user|>{name or "user"}<|im_middle|>{content}<|im_end|>                 user
    <|im_assistant|>{name or "assistant"}<|im_middle|>{content}<|im_end|>       assistant
    <|im_system|>{name or "system"}<|im_middle|>{content}<|im_end|>             system
    <|im_system|>{name or "tool"}<|im_middle|>## Return of {tool_call_id}\\n{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                                       generation prompt

Assistant `tool_calls` render after the content, as in K2, as `<|tool_calls_section_begin|>`, then per call
`<|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>`, then
`<|tool_calls_section_end|>`. Media parts render as Kimi-VL / K2.5 do,
`{media_begin}image<|media_content|>{placeholder}<|media_end|>` followed by a newline (the K2 template's
whitespace leaves one there), with K3's `<|kimi_image_placeholder|>` as the placeholder (one per
item; the vision path expands it to the item's embedding count). `video_url` parts say `video`.
Tokenizers pass `<|media_begin|>` / `<|media_pad|>` instead when their vocabulary has only those.
`continue_final_message=True` leaves a final assistant message open and adds no generation prompt
(whatever add_generation_prompt says); otherwise every message is closed with `<|im_end|>`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from k3ray.tokenizer import special as sp

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
ROLES = ("system", "user", "assistant", "tool")
MEDIA_PART_KINDS = {"image_url": "image", "video_url": "video"}
_ROLE_START = {"system": sp.IM_SYSTEM, "user": sp.IM_USER, "assistant": sp.IM_ASSISTANT, "tool": sp.IM_SYSTEM}


class ChatSegment(NamedTuple):
    """A piece of a rendered chat: control markup (encoded with special tokens) or message text."""

    text: str
    control: bool


class MediaItem(NamedTuple):
    """One image or video of a conversation, in the order its placeholder appears."""

    kind: str  # "image" | "video"
    source: Any  # the part's `image_url` / `video_url` value, e.g. {"url": "data:..."}


def render_chat(
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[dict] | None = None,
    media_begin: str = sp.MEDIA_START,
    media_placeholder: str = sp.KIMI_IMAGE_PLACEHOLDER,
) -> list[ChatSegment]:
    """Render a conversation; see the module docstring for the format. Raises ValueError on bad input."""
    _check_conversation(messages, continue_final_message)
    out: list[ChatSegment] = []
    if tools:
        out += _header(sp.IM_SYSTEM, "tool_declare") + [_text(_tools_json(tools)), _control(sp.IM_END)]
    if messages[0]["role"] != "system":
        out += _header(sp.IM_SYSTEM, "system") + [_text(DEFAULT_SYSTEM_PROMPT), _control(sp.IM_END)]
    for index, message in enumerate(messages):
        out += _render_message(message, f"messages[{index}]", media_begin, media_placeholder)
        if not (continue_final_message and index == len(messages) - 1):
            out.append(_control(sp.IM_END))
    if add_generation_prompt and not continue_final_message:
        out += _header(sp.IM_ASSISTANT, "assistant")
    return [segment for segment in out if segment.text]


def normalize_chat_role(message: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an OpenAI chat message with a role the template knows: `developer` (OpenAI's newer
    name for the system role) becomes `system`."""
    message = dict(message)
    if message.get("role") == "developer":
        message["role"] = "system"
    return message


def collect_media(messages: Sequence[dict]) -> list[MediaItem]:
    """The media items of a conversation in placeholder order (validates the messages as render_chat does)."""
    _check_conversation(messages, continue_final_message=False)
    items: list[MediaItem] = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for part_index, part in enumerate(content):
                where = f"messages[{index}].content[{part_index}]"
                kind = part_kind(part, where)
                if kind != "text":
                    items.append(MediaItem(kind, part[part["type"]]))
    return items


def _check_conversation(messages: Sequence[dict], continue_final_message: bool) -> None:
    check_messages(messages, ROLES)
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ValueError(
            f"continue_final_message=True needs a final assistant message, got role {messages[-1]['role']!r}"
        )


def check_messages(messages: Sequence[dict], roles: Sequence[str]) -> None:
    """A non-empty list of dicts, each with one of `roles` and a string name if any (ValueError naming it)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of message dicts, got {messages!r:.80}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        if message.get("role") not in roles:
            raise ValueError(f"messages[{index}] has unknown role {message.get('role')!r}; "
                             f"expected one of {tuple(roles)}")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"messages[{index}].name must be a string, got {type(name).__name__}")


def _render_message(message: dict, where: str, media_begin: str, placeholder: str) -> list[ChatSegment]:
    role = message["role"]
    out = _header(_ROLE_START[role], message.get("name") or role)
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and not tool_calls:
        raise ValueError(f"{where} (role {role!r}) has no content")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ValueError(f"{where} (role 'tool') needs a string tool_call_id, got {call_id!r}")
        out.append(_text(f"## Return of {call_id}\n"))
    if content is not None:
        out += _content_segments(content, f"{where}.content", media_begin, placeholder)
    if tool_calls:
        out += _tool_call_segments(tool_calls, f"{where}.tool_calls")
    return out


def _content_segments(content: Any, where: str, media_begin: str, placeholder: str) -> list[ChatSegment]:
    def media(kind: str) -> list[ChatSegment]:
        return [_control(media_begin), _text(kind), _control(sp.MEDIA_CONTENT), _control(placeholder),
                _control(sp.MEDIA_END), _text("\n")]

    return content_segments(content, where, media)


def content_segments(content: Any, where: str, media: Callable[[str], list[ChatSegment]]) -> list[ChatSegment]:
    """A message's content (a string, or text / image_url / video_url parts) as segments; `media`
    gives an image or video item's segments by its kind."""
    if isinstance(content, str):
        return [_text(content)]
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of parts, got {type(content).__name__}")
    out: list[ChatSegment] = []
    for index, part in enumerate(content):
        kind = part_kind(part, f"{where}[{index}]")
        out += [_text(part["text"])] if kind == "text" else media(kind)
    return out


def part_kind(part: Any, where: str) -> str:
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be a dict part, got {type(part).__name__}")
    part_type = part.get("type")
    if part_type == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where} is a 'text' part without a string 'text' field")
        return "text"
    if part_type in MEDIA_PART_KINDS:
        if part.get(part_type) is None:
            raise ValueError(f"{where} is an {part_type!r} part without its {part_type!r} field")
        return MEDIA_PART_KINDS[part_type]
    raise ValueError(f"{where} has unsupported part type {part_type!r}; expected 'text', 'image_url' or 'video_url'")


def _tool_call_segments(tool_calls: Any, where: str) -> list[ChatSegment]:
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where} must be a list, got {type(tool_calls).__name__}")
    out = [_control(sp.TOOL_CALLS_SECTION_BEGIN)]
    for index, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}[{index}] needs a 'function' dict with a string 'name'")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = call.get("id") or f"functions.{function['name']}:{index}"
        out += [_control(sp.TOOL_CALL_BEGIN), _text(call_id), _control(sp.TOOL_CALL_ARGUMENT_BEGIN)]
        out += [_text(arguments), _control(sp.TOOL_CALL_END)]
    return out + [_control(sp.TOOL_CALLS_SECTION_END)]


def _tools_json(tools: Sequence[dict]) -> str:
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
    # tokenization_kimi.py deep-sorts the tool schemas before rendering
    return json.dumps(deep_sorted(list(tools)), ensure_ascii=False, separators=(",", ":"))


def deep_sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: deep_sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sorted(item) for item in value]
    return value


def _header(start_token: str, name: str) -> list[ChatSegment]:
    return [_control(start_token), _text(name), _control(sp.IM_MIDDLE)]


def _control(text: str) -> ChatSegment:
    return ChatSegment(text, True)


def _text(text: str) -> ChatSegment:
    return ChatSegment(text, False)
