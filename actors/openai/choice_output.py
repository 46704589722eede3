"""One choice's output read as the chat APIs answer it: reasoning (`reasoning_content`), content and
tool calls, whole (`message`) or as stream deltas (`delta`), by the parser of the checkpoint's format
(K3's XTML: k3ray.tokenizer.xtml_output; K2's tool calls: k3ray.tokenizer.tool_calls); and a chat
request's thinking / tool_choice / response_format as the prompt takes them (`chat_options`)."""

from __future__ import annotations

import functools

from k3ray.actors.openai.errors import bad_request
from k3ray.actors.openai.protocol import ChatCompletionRequest, NamedToolChoice
from k3ray.tokenizer.chat_format import JINJA, output_reasons
from k3ray.tokenizer.chat_options import ChatOptions, options_from_kwargs
from k3ray.tokenizer.tool_calls import ParsedDelta, SpecialTokens, ToolCall, ToolCallParser
from k3ray.tokenizer.xtml_output import XtmlOutputParser


def chat_options(req: ChatCompletionRequest, tokenizer) -> ChatOptions:
    """The request's prompt options (a 400 naming chat_template_kwargs or reasoning_effort if bad)."""
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice
    if choice is None and req.tools:
        choice = "auto"
    response_format = req.response_format.model_dump(by_alias=True, exclude_none=True) \
        if req.response_format is not None else None
    try:
        return options_from_kwargs(req.chat_template_kwargs, req.reasoning_effort,
                                   any_kwargs=tokenizer.chat_format == JINJA, tool_choice=choice,
                                   response_format=response_format)
    except ValueError as e:
        param = "reasoning_effort" if str(e).startswith("reasoning_effort") else "chat_template_kwargs"
        raise bad_request(str(e), param) from e


def starts_thinking(req: ChatCompletionRequest, options: ChatOptions) -> bool:
    """Whether K3's prompt leaves its think channel open: thinking on, unless a continued final
    message with content left its response channel open (chat_xtml.py)."""
    return options.thinking_on() and not (req.continue_final_message and req.messages[-1].content)


def reads_output(tokenizer, tools) -> bool:
    """Whether the output is parsed (its text then keeps special tokens): always for K3's channels."""
    return output_reasons(tokenizer) or (tools is not None and tools.parse)


@functools.cache
def _special_tokens(tokenizer) -> SpecialTokens:
    return SpecialTokens.of(tokenizer)


class ChoiceOutput:
    def __init__(self, tokenizer, options: ChatOptions, tools, skip_special_tokens: bool, thinking: bool) -> None:
        """tools: the request's ToolPlan (None without tools); thinking: K3's output starts in its
        think channel (starts_thinking)."""
        self.reasons = output_reasons(tokenizer)
        max_calls = (tools.max_calls if tools.parse else 0) if tools is not None else 0
        keep = not skip_special_tokens
        self.parser = None
        if self.reasons:
            self.parser = XtmlOutputParser(_special_tokens(tokenizer), thinking=thinking,
                                           keep_specials=keep, max_calls=max_calls)
        elif tools is not None and tools.parse:
            self.parser = ToolCallParser(_special_tokens(tokenizer), keep, tools.max_calls)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole output's message and finish_reason."""
        if self.parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self._end(self.parser.feed(text), streamed=False, finish_reason=finish_reason)
        calls = self.parser.calls
        message = {"role": "assistant", "content": parsed.content or (None if calls else "")}
        if self.reasons:
            message["reasoning_content"] = parsed.reasoning or None
        if calls:
            message["tool_calls"] = [_call(c) for c in calls]
        return message, _finish_reason(calls, finish_reason)

    def delta(self, text: str, finished: bool, finish_reason: str | None) -> tuple[dict, str | None]:
        """The stream's delta for the output's next text (and its finish_reason once finished)."""
        if self.parser is None:
            return ({"content": text} if text else {}), (finish_reason if finished else None)
        parsed = self.parser.feed(text)
        if finished:
            parsed = self._end(parsed, streamed=True, finish_reason=finish_reason)
        return _delta(parsed), _finish_reason(self.parser.calls, finish_reason) if finished else None

    def _end(self, parsed: ParsedDelta, streamed: bool, finish_reason: str | None) -> ParsedDelta:
        if isinstance(self.parser, XtmlOutputParser):
            end = self.parser.finish()
        else:
            end = self.parser.finish(streamed=streamed, truncated=finish_reason == "length")
        return parsed.joined(end)


def _finish_reason(calls: list[ToolCall], finish_reason: str | None) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _call(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _delta(parsed: ParsedDelta) -> dict:
    delta: dict = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    calls = [{"index": c.index, "id": c.id, "type": "function",
              "function": {"name": c.name, "arguments": parsed.arguments.get(c.index, "")}} for c in parsed.started]
    started = {c.index for c in parsed.started}
    calls += [{"index": i, "function": {"arguments": text}} for i, text in parsed.arguments.items() if i not in started]
    if calls:
        delta["tool_calls"] = calls
    return delta
