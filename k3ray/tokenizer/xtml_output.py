"""K3's output read back: the think channel as reasoning, the response channel as content, the tools
channel as tool calls, fed piece by piece as the output streams in.

In thinking mode the generation prompt opens the think channel (chat_xtml.py), so the output starts
inside it with no open marker (a repeated `<|open|>think<|sep|>` is accepted); with thinking off it
starts inside the response channel:

    REASONING<|close|>think<|sep|><|open|>response<|sep|>TEXT<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|>
        <|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>      (or the arguments as one block)
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>

Elements are read at their `<|sep|>`, so a marker split across pieces is held back until whole and
never shows as content. A call is reported whole when its `<|close|>call<|sep|>` arrives, its typed
arguments decoded to one JSON object: string values raw, other types JSON-decoded (text that does not
decode is kept as the string, as vLLM's parser keeps it), attribute escapes undone. A call the output
ends inside (max_tokens) is dropped, never content; a call without a tool name is dropped. Text
outside any channel is content; other special tokens are dropped unless `keep_specials`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from k3ray.tokenizer import special as sp
from k3ray.tokenizer.tool_calls import CallStart, ParsedDelta, SpecialTextReader, SpecialTokens, ToolCall

MESSAGE_END = sp.CLOSE + "message" + sp.SEP  # K3's stop sequence: the assistant message's close
THINK, RESPONSE, BETWEEN, TOOLS, CALL, ARGUMENT, JSON_BLOCK, DONE = (
    "think", "response", "between", "tools", "call", "argument", "json", "done")
_ATTRIBUTE = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')


def xtml_marker_ids(tokenizer) -> tuple[int, int, int]:
    """The ids of `<|open|>`, `<|close|>`, `<|sep|>`; ValueError if the vocabulary lacks one."""
    missing = [m for m in sp.XTML_MARKERS if m not in tokenizer.special_tokens]
    if missing:
        raise ValueError(f"the tokenizer {tokenizer.name!r} has no XTML tokens {missing}")
    return tuple(tokenizer.special_tokens[m] for m in sp.XTML_MARKERS)  # type: ignore[return-value]


def unescape_attribute(value: str) -> str:
    """The inverse of chat_xtml.escape_attribute (`&quot;` first: `&amp;quot;` is the text `&quot;`)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def element_header(text: str) -> tuple[str, dict[str, str]]:
    """`call tool="f" index="1"` -> ("call", {"tool": "f", "index": "1"})."""
    name, _, rest = text.strip().partition(" ")
    return name, {k: unescape_attribute(v) for k, v in _ATTRIBUTE.findall(rest)}


def decode_argument(value: str, kind: str) -> Any:
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class XtmlOutputParser(SpecialTextReader):
    """Feed the output text (decoded with its special tokens) piece by piece, then `finish`; or `parse`."""

    def __init__(self, specials: SpecialTokens | None = None, thinking: bool = True, keep_specials: bool = False,
                 max_calls: int | None = None) -> None:
        """thinking: the prompt left the think channel open (else the response channel)."""
        self.specials = specials or SpecialTokens(sp.XTML_MARKERS)
        self.keep_specials = keep_specials
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self._state = THINK if thinking else RESPONSE
        self._fresh = True  # nothing read yet: a repeated open of the prompt's channel is accepted
        self._pending = ""  # may still grow into a special token
        self._marker: str | None = None  # OPEN or CLOSE whose header is being read up to SEP
        self._header = ""
        self._call: dict | None = None  # {"name", "arguments": dict, "raw": str | None}
        self._argument: tuple[str, str] | None = None  # (key, type) of the argument element being read
        self._value = ""
        self._delta = ParsedDelta()

    @classmethod
    def parse(cls, text: str, **kwargs: Any) -> ParsedDelta:
        """A whole output: reasoning, content and the calls it started (arguments by call index)."""
        parser = cls(kwargs.pop("specials", None), **kwargs)
        return parser.feed(text).joined(parser.finish())


    def finish(self) -> ParsedDelta:
        """The end of the output: held-back text is read as text; an unfinished call or element is dropped."""
        self._delta = ParsedDelta()
        pending, self._pending = self._pending, ""
        self._text(pending)
        self._marker, self._call, self._argument = None, None, None
        return self._delta

    # -- reading -----------------------------------------------------------------------------------
    def _text(self, text: str) -> None:
        if not text:
            return
        if self._marker is not None:
            self._header += text
            return
        if self._state == THINK:
            self._delta.reasoning += text
        elif self._state == RESPONSE:
            self._delta.content += text
        elif self._state in (ARGUMENT, JSON_BLOCK):
            self._value += text
        elif self._state == BETWEEN and text.strip():
            self._delta.content += text  # text outside any channel degrades to content
        # between calls, inside a call and after the message: whitespace or stray text, dropped
        self._fresh = False if text.strip() else self._fresh

    def _token(self, token: str) -> None:
        if token in (sp.OPEN, sp.CLOSE) and self._marker is None:
            self._marker, self._header = token, ""
        elif token == sp.SEP and self._marker is not None:
            marker, header = self._marker, self._header
            self._marker = None
            self._open(*element_header(header)) if marker == sp.OPEN else self._close(header.strip())
        elif self.keep_specials:
            self._text(token)

    def _open(self, name: str, attrs: dict[str, str]) -> None:
        state = self._state
        if state in (THINK, RESPONSE) and name == state and self._fresh:
            return  # the prompt's own channel opened again
        if state == THINK and name in (RESPONSE, TOOLS):
            state = BETWEEN  # a think channel never closed: the next channel ends it
        if state == RESPONSE and name == TOOLS:
            state = BETWEEN
        if state == BETWEEN and name in (RESPONSE, THINK, TOOLS):
            self._state = name
        elif state == TOOLS and name == "call":
            self._call = {"name": attrs.get("tool", ""), "arguments": {}, "raw": None}
            self._state = CALL
        elif state == CALL and name == "argument":
            self._argument, self._value, self._state = (attrs.get("key", ""), attrs.get("type", "string")), "", ARGUMENT
        elif state == CALL and name == "json":
            self._value, self._state = "", JSON_BLOCK
        else:
            self._stray(sp.OPEN + name + sp.SEP)
        self._fresh = False

    def _close(self, name: str) -> None:
        state = self._state
        if name == "message" and state not in (ARGUMENT, JSON_BLOCK, CALL):
            self._state = DONE
        elif name == state and state in (THINK, RESPONSE, TOOLS):
            self._state = BETWEEN
        elif state == ARGUMENT and name == "argument":
            key, kind = self._argument
            self._call["arguments"][key] = decode_argument(self._value, kind)
            self._state = CALL
        elif state == JSON_BLOCK and name == "json":
            self._call["raw"] = self._value
            self._state = CALL
        elif state == CALL and name == "call":
            self._end_call()
            self._state = TOOLS
        else:
            self._stray(sp.CLOSE + name + sp.SEP)
        self._fresh = False

    def _stray(self, element: str) -> None:
        """An element out of place: kept as text only when special tokens are kept."""
        if self.keep_specials and self._state in (THINK, RESPONSE):
            self._text(element)

    def _end_call(self) -> None:
        call, self._call = self._call, None
        if not call["name"] or (self.max_calls is not None and len(self.calls) >= self.max_calls):
            return
        arguments = _block_arguments(call["raw"], call["arguments"])
        index = len(self.calls)
        self.calls.append(ToolCall(index, f"functions.{call['name']}:{index}", call["name"], arguments))
        self._delta.started.append(CallStart(index, self.calls[-1].id, call["name"]))
        self._delta.arguments[index] = arguments


def _block_arguments(raw: str | None, typed: dict) -> str:
    """The call's arguments as JSON text: a json block's object (merged with typed ones), else the typed
    arguments; a block that is no JSON object is passed on as written."""
    if raw is not None:
        try:
            block = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        if not isinstance(block, dict):
            return raw
        typed = {**block, **typed}
    return json.dumps(typed, ensure_ascii=False)
