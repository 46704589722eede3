"""Kimi's tool calls in a model's output: the markers and an incremental parser.

The format (Kimi K2's, which k3ray's chat template renders for assistant `tool_calls`):

    text <|tool_calls_section_begin|>
           <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>
           ... more calls ...
         <|tool_calls_section_end|> text

`ToolCallParser` reads the output text (decoded with its special tokens) as it streams in and says
what it holds: content, and per call its id (`functions.NAME:INDEX`, what the model wrote and what
the chat template renders back), name and argument fragments. A marker split across pieces is held
back until it is whole, so no piece of one ever shows as content; other special tokens are dropped
unless `keep_specials`. A call whose header is not `functions.NAME:INDEX` is content, as is one the
output ends inside (`finish(streamed=False)`; a stream has sent its fragments already), as vLLM's
Kimi K2 parser degrades them. Pure Python: the OpenAI chat route uses it per choice.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from k3ray.tokenizer import special as sp

MARKERS = (sp.TOOL_CALLS_SECTION_BEGIN, sp.TOOL_CALL_BEGIN, sp.TOOL_CALL_ARGUMENT_BEGIN, sp.TOOL_CALL_END,
           sp.TOOL_CALLS_SECTION_END)  # the order of ToolCallsFormat.markers
HEADER = re.compile(r"(?:functions\.)?(?P<name>[^\s:.]+):(?P<index>[0-9]+)")


def marker_ids(tokenizer) -> tuple[int, int, int, int, int]:
    """The ids of MARKERS in tokenizer's vocabulary; ValueError if it lacks one."""
    missing = [m for m in MARKERS if m not in tokenizer.special_tokens]
    if missing:
        raise ValueError(f"the tokenizer {tokenizer.name!r} has no tool-call tokens {missing}")
    return tuple(tokenizer.special_tokens[m] for m in MARKERS)  # type: ignore[return-value]


@dataclass
class ToolCall:
    index: int  # among this output's calls
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ParsedDelta:
    """What one piece of output added: content, the calls it started, and per call index its new
    argument text."""

    content: str = ""
    started: list[CallStart] = field(default_factory=list)
    arguments: dict[int, str] = field(default_factory=dict)
    reasoning: str = ""  # K3's think channel (xtml_output.py); K2's format has none

    def __bool__(self) -> bool:
        return bool(self.content or self.started or self.arguments or self.reasoning)

    def joined(self, later: ParsedDelta) -> ParsedDelta:
        """This delta followed by `later`, as one."""
        arguments = dict(self.arguments)
        for index, text in later.arguments.items():
            arguments[index] = arguments.get(index, "") + text
        return ParsedDelta(self.content + later.content, self.started + later.started, arguments,
                           self.reasoning + later.reasoning)


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]


_TEXT, _SECTION, _HEADER, _ARGUMENTS = "text", "section", "header", "arguments"
_NEXT_STATE = {  # (state, the marker it expects) -> the state the marker starts
    (_TEXT, sp.TOOL_CALLS_SECTION_BEGIN): _SECTION, (_SECTION, sp.TOOL_CALL_BEGIN): _HEADER,
    (_HEADER, sp.TOOL_CALL_ARGUMENT_BEGIN): _ARGUMENTS, (_ARGUMENTS, sp.TOOL_CALL_END): _SECTION,
    (_SECTION, sp.TOOL_CALLS_SECTION_END): _TEXT,
}


class SpecialTokens:
    """How the parser finds special tokens in text: built once per tokenizer (`of`)."""

    def __init__(self, specials: Iterable[str] = ()) -> None:
        names = set(specials) or set(MARKERS)
        self.pattern = re.compile("|".join(map(re.escape, sorted(names, key=len, reverse=True))))
        self.prefixes = frozenset(name[:i] for name in names for i in range(1, len(name)))
        self.longest = max(map(len, names))

    @classmethod
    def of(cls, tokenizer) -> SpecialTokens:
        """Every special token of tokenizer (its named and reserved ones)."""
        return cls(tokenizer.special_tokens)

    def held_back(self, text: str) -> int:
        """The length of text's longest suffix that could still grow into a special token."""
        return next((n for n in range(min(len(text), self.longest - 1), 0, -1) if text[-n:] in self.prefixes), 0)


class SpecialTextReader:
    """Output text fed piece by piece, split into text and whole special tokens (`_text`, `_token`);
    the tail that may still grow into a special token is held back until the next piece."""

    specials: SpecialTokens
    _pending: str
    _delta: ParsedDelta

    def feed(self, text: str) -> ParsedDelta:
        """What `text`, the output's next piece, adds."""
        self._delta = ParsedDelta()
        text = self._pending + text
        start = 0
        for match in self.specials.pattern.finditer(text):
            self._text(text[start:match.start()])
            self._token(match.group())
            start = match.end()
        rest = text[start:]
        held = self.specials.held_back(rest)
        self._text(rest[:len(rest) - held])
        self._pending = rest[len(rest) - held:]
        return self._delta

    def _text(self, text: str) -> None:
        raise NotImplementedError

    def _token(self, token: str) -> None:
        raise NotImplementedError


class ToolCallParser(SpecialTextReader):
    """Feed the output text piece by piece (`feed`), then `finish`; or `parse` it whole."""

    def __init__(self, specials: SpecialTokens | None = None, keep_specials: bool = False,
                 max_calls: int | None = None) -> None:
        """specials: the tokenizer's (the markers alone without), dropped from content and arguments
        unless keep_specials; calls past max_calls are left out."""
        self.specials = specials or SpecialTokens()
        self.keep_specials = keep_specials
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []  # reported: complete, or being read
        self._state = _TEXT
        self._pending = ""  # may still grow into a special token
        self._header = ""
        self._call_raw = ""  # the call being read as written: content if it turns out malformed or unfinished
        self._call: ToolCall | None = None  # None while its header is read, or when that was malformed
        self._reported = False  # whether _call is in calls
        self._delta = ParsedDelta()

    @classmethod
    def parse(cls, text: str, specials: SpecialTokens | None = None, keep_specials: bool = False,
              max_calls: int | None = None) -> ParsedOutput:
        """A whole output: its content and complete calls (an unfinished call is content)."""
        parser = cls(specials, keep_specials, max_calls)
        content = parser.feed(text).content + parser.finish(streamed=False).content
        return ParsedOutput(content, parser.calls)


    def finish(self, streamed: bool = True, truncated: bool = False) -> ParsedDelta:
        """The end of the output: held-back text, and a call header never finished, are content; so
        is a call never finished unless streamed (its fragments were sent) or truncated (max_tokens
        cut it: a cut call is dropped, never content)."""
        self._delta = ParsedDelta()
        self._text(self._pending)
        self._pending = ""
        if truncated and self._state in (_HEADER, _ARGUMENTS):
            if self._reported and self._call is not None and not streamed:
                self.calls.pop()
        elif self._state == _HEADER:
            self._delta.content += self._call_raw
        elif self._state == _ARGUMENTS and self._call is not None and not streamed and self._reported:
            self.calls.pop()
            self._delta.content += self._call_raw
        self._state = _TEXT
        return self._delta

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._state == _TEXT:
            self._delta.content += text
        elif self._state == _HEADER:
            self._header += text
            self._call_raw += text
        elif self._state == _ARGUMENTS:
            self._call_raw += text
            if self._call is None:
                self._delta.content += text
            else:
                self._call.arguments += text
                if self._reported:
                    index = self._call.index
                    self._delta.arguments[index] = self._delta.arguments.get(index, "") + text
        # text between calls is dropped, as vLLM's parser drops it

    def _token(self, token: str) -> None:
        state = _NEXT_STATE.get((self._state, token))
        if state is None:  # any other special token, or a marker out of place
            if self.keep_specials:
                self._text(token)
            return
        kept = token if self.keep_specials else ""
        if state == _HEADER:
            self._header, self._call_raw, self._call = "", kept, None
        elif state == _ARGUMENTS:
            self._call_raw += kept
            self._start_call()
        elif self._state == _ARGUMENTS and self._call is None:  # a malformed call's end
            self._delta.content += kept
        self._state = state

    def _start_call(self) -> None:
        match = HEADER.fullmatch(self._header.strip())
        if match is None:  # malformed: the call is content
            self._delta.content += self._call_raw
            return
        self._call = ToolCall(len(self.calls), self._header.strip(), match.group("name"))
        self._reported = self.max_calls is None or len(self.calls) < self.max_calls
        if self._reported:
            self.calls.append(self._call)
            self._delta.started.append(CallStart(self._call.index, self._call.id, self._call.name))
