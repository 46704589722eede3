"""/v1/responses <-> the chat path, pure functions: a Responses request -> a chat request
(`chat_request`: input items -> messages, Responses tools -> chat tools), a chat.completion -> a
Response (`response_body`: reasoning, message and function_call output items), and a chat
error -> one naming the Responses fields."""

from __future__ import annotations

import re
import uuid

from k3ray.actors.openai.errors import APIError, bad_request
from k3ray.actors.openai.protocol import ChatCompletionRequest
from k3ray.actors.openai.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ImagePart,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

# a chat field named in an error -> the Responses field the client sent
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort"}
_WORDS = re.compile(r"\b(response_format\.json_schema\.schema|max_completion_tokens|max_tokens|response_format)\b")
_WORD_NAMES = {"response_format.json_schema.schema": "text.format.schema", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_error(e: APIError) -> APIError:
    """An error about the chat request, in the Responses fields the client sent."""
    head = re.match(r"[a-z_]+", e.param or "")
    param = _PARAMS.get(head.group(), e.param) if head else e.param
    message = _WORDS.sub(lambda m: _WORD_NAMES[m.group()], e.message)
    return APIError(e.status, message, param, e.code, e.headers)


# request -----------------------------------------------------------------------------------------
def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    body: dict = {"model": req.model, "messages": chat_messages(req), "stream": False}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for field in ("temperature", "top_p", "seed", "user", "parallel_tool_calls"):
        if getattr(req, field) is not None:
            body[field] = getattr(req, field)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    response_format = _response_format(req)
    if response_format is not None:
        body["response_format"] = response_format
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return ChatCompletionRequest.model_validate(body)


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    schema = {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """instructions and input -> chat messages: function_call items join the assistant message before
    them (or make one), function_call_output items are tool messages, reasoning items the
    reasoning_content of the next assistant message. A 400 names a call_id no function_call made."""
    messages: list[dict] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    reasoning: list[str] = []
    calls: set[str] = set()

    def assistant(message: dict) -> dict:
        if reasoning:
            message["reasoning_content"] = "\n\n".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            message = {"role": item.role, "content": _content(item.content)}
            if item.role == "assistant":
                assistant(message)
            else:
                messages.append(message)
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning:
                last = assistant({"role": "assistant", "content": None})
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise bad_request(f"input[{i}] is the output of call_id {item.call_id!r}, which no earlier "
                                  "function_call item made", f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
        elif isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            reasoning.append("\n\n".join(p.text for p in parts))
    if not messages:
        raise bad_request("input has no message to answer (reasoning items alone are dropped)", "input")
    return messages


def _content(content) -> str | list[dict]:
    if isinstance(content, str):
        return content
    return [{"type": "image_url", "image_url": {"url": p.image_url}} if isinstance(p, ImagePart)
            else {"type": "text", "text": p.text} for p in content]


# response ----------------------------------------------------------------------------------------
def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def reasoning_item(text: str, id_: str) -> dict:
    return {"type": "reasoning", "id": id_, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def message_item(text: str, id_: str) -> dict:
    return {"type": "message", "id": id_, "role": "assistant", "status": "completed",
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, id_: str) -> dict:
    return {"type": "function_call", "id": id_, "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def output_items(message: dict) -> list[dict]:
    """A chat message -> its output items: its thinking, its text (if any, or nothing was called), its calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"], item_id("rs")))
    if message.get("content") is not None:
        items.append(message_item(message["content"], item_id("msg")))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"],
                                        item_id("fc")))
    return items


def response_body(req: ResponsesRequest, chat: dict, response_id: str, created_at: int, model: str) -> dict:
    """The Response for a whole chat.completion body."""
    (choice,) = chat["choices"]
    return finished_response(req, response_id, created_at, model, output_items(choice["message"]),
                             choice["finish_reason"], chat["usage"])


def finished_response(req: ResponsesRequest, response_id: str, created_at: int, model: str, output: list[dict],
                      finish_reason: str | None, chat_usage: dict) -> dict:
    body = response_skeleton(req, response_id, created_at, model)
    incomplete = finish_reason == "length"
    body.update(status="incomplete" if incomplete else "completed", output=output,
                incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                usage=response_usage(chat_usage))
    return body


def response_usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_skeleton(req: ResponsesRequest, response_id: str, created_at: int, model: str) -> dict:
    """The Response before its output: the request's settings echoed, as OpenAI answers them."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
        "model": model, "output": [], "error": None, "incomplete_details": None,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": False, "background": False, "previous_response_id": None, "user": req.user,
        "truncation": "disabled", "usage": None,
    }
