"""What a chat request asks of the prompt beyond its messages: thinking, its effort, tool_choice and
response_format, as K3's release tokenizer takes them (`apply_chat_template(thinking=...,
thinking_effort=..., tool_choice=..., response_format=...)`); formats without them ignore them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EFFORTS = ("low", "high", "max")
DEFAULT_EFFORT = "max"  # the release tokenizer's apply_chat_template default
# OpenAI's reasoning_effort values onto K3's three (`none` turns thinking off)
REASONING_EFFORTS = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


@dataclass(frozen=True)
class ChatOptions:
    thinking: bool | None = None  # None: on, as K3's release tokenizer defaults
    thinking_effort: str | None = DEFAULT_EFFORT  # low | high | max; None: no effort message
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    response_format: Mapping | None = None  # {"type": "json_object"} | {"type": "json_schema", "json_schema": {...}}
    template_kwargs: Mapping | None = None  # chat_template_kwargs as sent: what a Jinja template reads

    def __post_init__(self) -> None:
        if self.thinking is not None and not isinstance(self.thinking, bool):
            raise ValueError(f"thinking must be true or false, got {self.thinking!r}")
        if self.thinking_effort is not None and self.thinking_effort not in EFFORTS:
            raise ValueError(f"thinking_effort must be one of {', '.join(EFFORTS)}, got {self.thinking_effort!r}")

    def thinking_on(self) -> bool:
        return self.thinking is not False

    def effort(self) -> str | None:
        return self.thinking_effort if self.thinking_on() else None

    def tool_choice_mode(self) -> str | None:
        """auto / none / required, or `named` for one function (which K3's prompt does not state)."""
        if isinstance(self.tool_choice, Mapping):
            return "named"
        return self.tool_choice


def options_from_kwargs(kwargs: Mapping[str, Any] | None, reasoning_effort: str | None = None,
                        any_kwargs: bool = False, **fields: Any) -> ChatOptions:
    """ChatOptions from vLLM's `chat_template_kwargs` (`thinking`, else `enable_thinking`;
    `thinking_effort`) and OpenAI's `reasoning_effort` (`none` turns thinking off; another fills an
    effort not given); ValueError naming the bad one. any_kwargs: a Jinja template takes whatever keys
    it reads, so none is refused."""
    kwargs = dict(kwargs or {})
    fields["template_kwargs"] = dict(kwargs)
    thinking = kwargs.pop("thinking", None)
    enable_thinking = kwargs.pop("enable_thinking", None)  # Qwen's name, which vLLM users send
    if thinking is None:
        thinking = enable_thinking
    effort_given = "thinking_effort" in kwargs  # given as null: no effort message, as the release
    effort = kwargs.pop("thinking_effort", None)
    if reasoning_effort is not None:
        if reasoning_effort == "none":  # as vLLM's K3 renderer: OpenAI's "none" turns thinking off
            thinking = False
        elif reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of none, {', '.join(REASONING_EFFORTS)}, got "
                             f"{reasoning_effort!r}")
        elif effort is None:
            effort = REASONING_EFFORTS[reasoning_effort]
    if kwargs and not any_kwargs:
        raise ValueError(f"chat_template_kwargs: unknown keys {sorted(kwargs)}; this server's chat format takes "
                         "thinking, enable_thinking and thinking_effort")
    if effort is None and not effort_given:
        effort = DEFAULT_EFFORT
    return ChatOptions(thinking=thinking, thinking_effort=effort, **fields)
