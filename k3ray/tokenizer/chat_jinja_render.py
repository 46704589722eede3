"""A checkpoint's own Jinja chat template, rendered as Hugging Face's `apply_chat_template` renders it:
a sandboxed environment with trim_blocks / lstrip_blocks and loop controls, its `tojson` filter,
`raise_exception` and `strftime_now`, the special tokens by name, and `chat_template_kwargs`."""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3ray.tokenizer.chat_options import ChatOptions


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception), or failed to render it."""


def render_jinja(tokenizer, messages: Sequence[dict], add_generation_prompt: bool, continue_final_message: bool,
                 tools: Sequence[dict] | None, options: ChatOptions) -> str:
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message=True needs a final assistant message")
    names = {f"{kind}_token": tokenizer.convert_ids_to_tokens([getattr(tokenizer, f"{kind}_token_id")])[0]
             for kind in ("bos", "eos", "pad")}
    kwargs = {**names, **dict(options.template_kwargs or {})}
    try:
        text = _compiled(tokenizer.chat_template).render(
            messages=list(messages), tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt and not continue_final_message, **kwargs)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the checkpoint's chat template failed: {e}") from None
    if continue_final_message:
        text = _cut_after_final(text, messages[-1])
    return text


def _cut_after_final(text: str, final: dict) -> str:
    """The prompt up to the final message's content, so the model continues it (as transformers cuts)."""
    content = final.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    content = (content or "").strip()
    at = text.rfind(content) if content else -1
    if at < 0:
        raise ValueError("continue_final_message: the final message's content is not in the rendered template")
    return text[:at + len(content)]


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the checkpoint's chat template does not compile: {e}") from None
