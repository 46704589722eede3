"""What an eval talks to: anything that tokenizes like the model and completes a prompt.

A prompt is either plain text (sent to a completions route) or a list of OpenAI chat messages
(sent to a chat route; multimodal prompts carry `image_url` / `video_url` parts with data: URLs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

Prompt = str | list[dict[str, Any]]


@runtime_checkable
class Target(Protocol):
    """A model endpoint or engine under evaluation.

    `tokenize` must count exactly what the model sees for a text prompt (special tokens the
    completions route adds included), so prompt lengths can be made token-exact.
    """

    name: str
    max_context: int | None

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def complete(self, prompt: Prompt, max_tokens: int) -> str: ...


def count_tokens(target: Target, text: str) -> int:
    """Token count of `text` for `target`, through a cheaper `count_tokens` method when it has one."""
    counter = getattr(target, "count_tokens", None)
    return counter(text) if counter is not None else len(target.tokenize(text))


def tokens_computed(target: Target) -> Callable[[], int | None] | None:
    """The target's running count of tokens its model computed (prompt tokens, prefix-cache hits,
    generated tokens; None while it cannot tell), when it keeps one."""
    return getattr(target, "tokens_computed", None)


def count_chat_tokens(target: Target, messages: list[dict[str, Any]]) -> int | None:
    """Tokens the model sees for a chat prompt (media included) when `target` can tell, else None."""
    counter = getattr(target, "count_chat_tokens", None)
    return None if counter is None else counter(messages)


def as_user_message(text: str) -> list[dict[str, Any]]:
    """A text prompt as a chat: one user message, as an OpenAI client's chat call sends it."""
    return [{"role": "user", "content": text}]


def chat_overhead(target: Target) -> int:
    """Tokens a chat adds around one user message's text (the template's markers and generation
    prompt, less what a completion adds), as `target` counts them: a chat item's text gets that many
    fewer, so the model sees the cell's length."""
    probe = "x"
    chat = count_chat_tokens(target, as_user_message(probe))
    if chat is None:
        raise ValueError(f"{target.name} cannot count chat prompts' tokens, which chat items need "
                         "(an endpoint: POST /tokenize with messages)")
    return chat - count_tokens(target, probe)


def chat_text(prompt: Prompt) -> str | None:
    """The text of a chat whose messages are all plain text, joined; None for text or media prompts."""
    if isinstance(prompt, str) or not all(isinstance(m.get("content"), str) for m in prompt):
        return None
    return "\n".join(m["content"] for m in prompt)
