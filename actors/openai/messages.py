"""POST /v1/messages (Anthropic's Messages API, as vLLM serves it) and /v1/messages/count_tokens, on
the chat path: the request becomes a chat completion request (`chat_request`), is checked and
rendered by `prepare_chat`, and the chat answer becomes a message (`message_body`) or, streamed,
Anthropic's events (`MessageEvents`).

Blocks map onto chat messages: text and image blocks are content parts, a user's tool_result a
`tool` message under the tool_use's id, an assistant's thinking its `reasoning_content` and its
tool_use blocks its `tool_calls` (redacted_thinking is dropped). Errors are Anthropic's shape
(openai/messages_errors.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

from k3ray.actors.openai.chat import chat_chunks, chat_response, prepare_chat
from k3ray.actors.openai.errors import UNAVAILABLE, APIError, as_api_error, bad_request, log_failure
from k3ray.actors.openai.messages_errors import api_error_body
from k3ray.actors.openai.messages_protocol import (
    AssistantMessage,
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
)
from k3ray.actors.openai.protocol import ChatCompletionRequest
from k3ray.actors.openai.serving import OpenAIServing, request_error

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
SIGNATURE = ""  # K3's thinking is not signed; a thinking block sent back is read, its signature not checked


async def create_message(serving: OpenAIServing, req: MessagesRequest) -> dict | AsyncIterator[str]:
    async with _as_api_errors():
        turn = await prepare_chat(serving, chat_request(req), id_prefix="msg")
        if req.stream:
            return _events(serving, turn, req.stop_sequences)
        return message_body(await chat_response(serving, turn), req.stop_sequences)


async def count_tokens(serving: OpenAIServing, req: CountTokensRequest) -> dict:
    """The prompt's tokens (media expanded) as /v1/messages would render it."""
    async with _as_api_errors():
        turn = await prepare_chat(serving, chat_request(req), id_prefix="msg")
        return {"input_tokens": turn.prompt.num_tokens}


@asynccontextmanager
async def _as_api_errors() -> AsyncIterator[None]:
    """Any failure as an APIError, which the error middleware answers in Anthropic's shape (Starlette's
    catch-all for other exceptions sits outside every middleware); an unavailable model is left to its
    handler, which knows the server's Retry-After."""
    try:
        yield
    except (APIError, *UNAVAILABLE):
        raise
    except ValueError as e:
        raise request_error(e) from e
    except Exception as e:  # noqa: BLE001
        log_failure(e)
        raise as_api_error(e) from e


# request -------------------------------------------------------------------------------------------
def chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request of a Messages request; an APIError (400) for a tool_result whose
    tool_use_id names no tool_use of the last assistant message before it, or a tool_choice naming no tool."""
    messages = _system(req.system)
    tool_use_ids: set[str] = set()  # those of the last assistant message
    for i, m in enumerate(req.messages):
        if isinstance(m, UserMessage):
            messages += _user_messages(m, i, tool_use_ids)
        else:
            messages.append(_assistant_message(m))
            tool_use_ids = {c["id"] for c in messages[-1].get("tool_calls", ())}
    body: dict = {"model": req.model, "messages": messages}
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):  # a prefill: continued
        body.update(add_generation_prompt=False, continue_final_message=True)
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description is not None else {}),
            "parameters": t.input_schema}} for t in req.tools]
    body.update(_tool_choice(req))
    if req.thinking is not None and req.thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"thinking": req.thinking.type == "enabled"}
    if isinstance(req, MessagesRequest):
        body.update({k: v for k, v in (("max_tokens", req.max_tokens), ("stop", req.stop_sequences),
                                        ("temperature", req.temperature), ("top_p", req.top_p),
                                        ("top_k", req.top_k), ("seed", req.seed)) if v is not None})
        if req.metadata is not None and req.metadata.user_id is not None:
            body["user"] = req.metadata.user_id
    return ChatCompletionRequest.model_validate(body)


def _system(system: str | list[TextBlock] | None) -> list[dict]:
    if not system:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": [_part(b) for b in system]}]


def _user_messages(m: UserMessage, index: int, tool_use_ids: set[str]) -> list[dict]:
    """A user message's blocks in order: its text and images as user messages, each tool_result as a
    tool message between them."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(m.content):
        if not isinstance(block, ToolResultBlock):
            parts.append(_part(block))
            continue
        if block.tool_use_id not in tool_use_ids:
            raise bad_request(f"messages[{index}].content[{j}].tool_use_id: {block.tool_use_id!r} names no tool_use "
                              "block of the last assistant message before it", "messages")
        if parts:
            out.append({"role": "user", "content": parts})
            parts = []
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_content(block)})
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _result_content(block: ToolResultBlock) -> str | list[dict]:
    prefix = "Error: " if block.is_error else ""
    if block.content is None or isinstance(block.content, str):
        return prefix + (block.content or "")
    parts = [_part(b) for b in block.content]
    return [{"type": "text", "text": prefix}, *parts] if prefix else parts


def _part(block: TextBlock | ImageBlock) -> dict:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    source = block.source
    url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant_message(m: AssistantMessage) -> dict:
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    text, thinking, calls = [], [], []
    for block in m.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            assert isinstance(block, RedactedThinkingBlock)
    message: dict = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_choice(req: MessagesRequest | CountTokensRequest) -> dict:
    choice = req.tool_choice
    if choice is None:
        return {}
    if isinstance(choice, ToolChoiceTool) and choice.name not in [t.name for t in req.tools or ()]:
        raise bad_request(f"tool_choice names the tool {choice.name!r}, which is not one of tools", "tool_choice")
    out: dict = {"tool_choice": "none" if isinstance(choice, ToolChoiceNone) else
                 "required" if isinstance(choice, ToolChoiceAny) else
                 {"type": "function", "function": {"name": choice.name}} if isinstance(choice, ToolChoiceTool) else
                 "auto"}
    if getattr(choice, "disable_parallel_tool_use", None) and req.tools:
        out["parallel_tool_calls"] = False
    return out


# response ------------------------------------------------------------------------------------------
def message_body(chat: dict, stop_sequences: list[str] | None = None) -> dict:
    """A chat.completion body (one choice) as a message."""
    (choice,) = chat["choices"]
    message, content = choice["message"], []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": SIGNATURE})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    stop_reason, stop_sequence = stop_of(choice["finish_reason"], choice.get("stop_reason"), stop_sequences)
    return {"id": message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": chat["usage"]["prompt_tokens"],
                      "output_tokens": chat["usage"]["completion_tokens"]}}


def message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("msg-")  # Anthropic's ids read msg_...


def tool_input(arguments: str) -> dict:
    """A call's JSON arguments as tool_use input (which is an object; a model free to write anything
    may write something else, which then reads as no input)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(finish_reason: str | None, stop_reason, stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and stop_reason (the stop string
    it stopped at, a stop token id, or None for EOS)."""
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason, finish_reason), None


# stream --------------------------------------------------------------------------------------------
def event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class MessageEvents:
    """chat.completion.chunk dicts (one choice) -> Anthropic's stream events, as dicts: a content block
    per run of thinking, of text, and per tool call, in the order the output has them."""

    def __init__(self, message_id: str, model: str, input_tokens: int, stop_sequences: list[str] | None) -> None:
        self.message_id, self.model, self.input_tokens = message_id, model, input_tokens
        self.stop_sequences = stop_sequences
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the open block's kind: thinking, text, or tool_use
        self.calls: dict[int, int] = {}  # a tool call's index -> its block's index
        self.finish: tuple[str | None, object] = (None, None)

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}]

    def chunk(self, chunk: dict) -> list[dict]:
        out: list[dict] = []
        if not chunk["choices"]:  # the last chunk: usage
            out += self._close()
            stop_reason, stop_sequence = stop_of(*self.finish, self.stop_sequences)
            out.append({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": chunk["usage"]["completion_tokens"]}})
            out.append({"type": "message_stop"})
            return out
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            out += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open != kind:
            out += self._close()
            block = {"type": "thinking", "thinking": "", "signature": SIGNATURE} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out += self._open(kind, block)
        field = "thinking" if kind == "thinking" else "text"
        out.append({"type": "content_block_delta", "index": self.blocks - 1,
                    "delta": {"type": f"{field}_delta", field: text}})
        return out

    def _call(self, call: dict) -> list[dict]:
        out = []
        if call["index"] not in self.calls:  # a call's first fragment names it
            out += self._close()
            self.calls[call["index"]] = self.blocks
            out += self._open("tool_use", {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                           "input": {}})
        arguments = (call.get("function") or {}).get("arguments")
        if arguments:
            out.append({"type": "content_block_delta", "index": self.calls[call["index"]],
                        "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return out

    def _open(self, kind: str, block: dict) -> list[dict]:
        self.open = kind
        self.blocks += 1
        return [{"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]


async def _events(serving: OpenAIServing, turn, stop_sequences: list[str] | None) -> AsyncIterator[str]:
    events = MessageEvents(message_id(turn.request_id), serving.model_name, turn.prompt.num_tokens, stop_sequences)
    for payload in events.start():
        yield event(payload)
    try:
        async with aclosing(chat_chunks(serving, turn)) as chunks:
            async for chunk in chunks:
                for payload in events.chunk(chunk):
                    yield event(payload)
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        log_failure(e)
        err = request_error(e) if isinstance(e, ValueError) else as_api_error(e)
        yield event(api_error_body(err))
