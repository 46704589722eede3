"""Which chat format a checkpoint speaks, picked from its tokenizer files, and what follows from it:
how a conversation becomes prompt ids, and how the model's output is read back.

- `jinja`: the checkpoint ships a Jinja `chat_template` (one k3ray did not write): rendered in a
  sandbox as Hugging Face's `apply_chat_template` renders it, ids equal to its `tokenize=True`.
- `kimi_k3_xtml`: K3's vocabulary (`<|open|>`, `<|sep|>`, `<|close|>`) and no template, as K3's
  release ships: chat_xtml.py renders, xtml_output.py reads thinking, response and tool calls.
- `kimi_k2`: Kimi K2's vocabulary: chat.py renders, tool_calls.py reads tool calls.

A Jinja checkpoint's output is read by the parser its vocabulary implies (XTML's or K2's).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from k3ray.tokenizer import special as sp
from k3ray.tokenizer.chat import ChatSegment, render_chat
from k3ray.tokenizer.chat_options import ChatOptions
from k3ray.tokenizer.chat_xtml import media_item, render_xtml_chat

KIMI_K2, KIMI_K3_XTML, JINJA = "kimi_k2", "kimi_k3_xtml", "jinja"
FORMATS = (KIMI_K2, KIMI_K3_XTML, JINJA)


def native_format(special_tokens) -> str:
    """The format a vocabulary's markers imply: K3's XTML when it has all three, else K2's."""
    return KIMI_K3_XTML if all(m in special_tokens for m in sp.XTML_MARKERS) else KIMI_K2


def pick_format(special_tokens, chat_template: str | None, declared: str | None = None) -> str:
    """A checkpoint's format: the one its files declare (k3ray's own tokenizers), a shipped Jinja
    template, else what its vocabulary implies."""
    if declared is not None:
        if declared not in FORMATS:
            raise ValueError(f"unknown chat format {declared!r}; expected one of {FORMATS}")
        return declared
    return JINJA if chat_template else native_format(special_tokens)


def render_segments(tokenizer, messages: Sequence[dict], add_generation_prompt: bool, continue_final_message: bool,
                    tools: Sequence[dict] | None, options: ChatOptions) -> list[ChatSegment]:
    """The conversation as control / text segments in tokenizer's format (a Jinja render is one
    control segment: Hugging Face encodes the rendered string with its special tokens)."""
    fmt = tokenizer.chat_format
    if fmt == JINJA:
        from k3ray.tokenizer.chat_jinja_render import render_jinja  # lazy: jinja2 only for such checkpoints

        text = render_jinja(tokenizer, messages, add_generation_prompt, continue_final_message, tools, options)
        return [ChatSegment(text, True)]
    if fmt == KIMI_K3_XTML:
        return render_xtml_chat(messages, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, tools=tools, options=options,
                                media_prompt=functools.partial(media_item, begin=tokenizer.media_begin_token,
                                                               placeholder=tokenizer.media_placeholder_token))
    return render_chat(messages, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools,
                       media_begin=tokenizer.media_begin_token, media_placeholder=tokenizer.media_placeholder_token)


def encode_segments(tokenizer, segments: Sequence[ChatSegment]) -> list[int]:
    """Prompt ids: only control segments may hold special tokens. XTML encodes each segment on its
    own, as K3's release tokenizer does; K2's joins neighbours of one kind first (its template is
    one string)."""
    runs = [(s.control, s.text) for s in segments] if tokenizer.chat_format == KIMI_K3_XTML else \
        _merged_runs(segments)
    ids: list[int] = []
    for control, run in runs:
        ids += tokenizer.encode(run, allow_special=control)
    return ids


def output_reasons(tokenizer) -> bool:
    """Whether outputs in tokenizer's format have a reasoning channel to read (XTML's think)."""
    return native_format(tokenizer.special_tokens) == KIMI_K3_XTML


def _merged_runs(segments: Sequence[ChatSegment]) -> list[tuple[bool, str]]:
    """Adjacent segments of one kind joined, so text encodes exactly as in the joined prompt string."""
    runs: list[tuple[bool, str]] = []
    for text, control in segments:
        if runs and runs[-1][0] == control:
            runs[-1] = (control, runs[-1][1] + text)
        else:
            runs.append((control, text))
    return runs
