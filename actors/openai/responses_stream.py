"""A streamed /v1/responses answer: the chat turn's chunks as Responses server-sent events.

One output item is open at a time (reasoning, then the message, then each function call, as the
model writes them); each is opened (output_item.added, content_part.added), grown (its text or
arguments deltas) and closed (.done events); response.completed (or response.incomplete) carries
the whole Response, which equals the unstreamed one. A failure after the events begin is an
`error` event and response.failed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

from k3ray.actors.openai.chat import ChatTurn, chat_chunks
from k3ray.actors.openai.errors import as_api_error, log_failure
from k3ray.actors.openai.responses_convert import (
    finished_response,
    function_call_item,
    item_id,
    message_item,
    output_text,
    reasoning_item,
    response_skeleton,
    responses_error,
)
from k3ray.actors.openai.responses_protocol import ResponsesRequest
from k3ray.actors.openai.serving import OpenAIServing, request_error

_DELTA = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta",
          "function_call": "response.function_call_arguments.delta"}


class _OpenItem:
    def __init__(self, kind: str, index: int, call_id: str = "", name: str = "") -> None:
        self.kind, self.index, self.call_id, self.name = kind, index, call_id, name
        self.id = item_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.text = ""

    def item(self) -> dict:
        if self.kind == "reasoning":
            return reasoning_item(self.text, self.id)
        if self.kind == "message":
            return message_item(self.text, self.id)
        return function_call_item(self.call_id, self.name, self.text, self.id)

    def part(self) -> dict:
        return {"type": "reasoning_text", "text": self.text} if self.kind == "reasoning" else output_text(self.text)


class ResponseEvents:
    """The events of one response, numbered; fed chat chunks."""

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int, model: str) -> None:
        self.skeleton = response_skeleton(req, response_id, created_at, model)
        self.req, self.response_id, self.created_at, self.model = req, response_id, created_at, model
        self.sequence = 0
        self.done: list[dict] = []
        self.open: _OpenItem | None = None
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> Iterator[str]:
        yield self.event("response.created", response=self.skeleton)
        yield self.event("response.in_progress", response=self.skeleton)

    def chunk(self, chunk: dict) -> Iterator[str]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                yield from self._grow("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                yield from self._grow("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                if call.get("id"):  # a call's first fragment
                    yield from self._close()
                    yield from self._open(_OpenItem("function_call", len(self.done), call["id"],
                                                    call["function"]["name"]))
                if call["function"].get("arguments") and self.open is not None:
                    yield from self._grow("function_call", call["function"]["arguments"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def finish(self) -> Iterator[str]:
        yield from self._close()
        if not any(item["type"] in ("message", "function_call") for item in self.done):
            yield from self._open(_OpenItem("message", len(self.done)))  # an empty answer is an empty message
            yield from self._close()
        body = finished_response(self.req, self.response_id, self.created_at, self.model, self.done,
                                 self.finish_reason, self.usage or {"prompt_tokens": 0, "completion_tokens": 0,
                                                                    "total_tokens": 0})
        yield self.event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                         response=body)

    def fail(self, e: BaseException) -> Iterator[str]:
        log_failure(e)
        err = responses_error(request_error(e) if isinstance(e, ValueError) else as_api_error(e))
        yield self.event("error", code=err.code, message=err.message, param=err.param)
        body = {**self.skeleton, "status": "failed", "output": self.done,
                "error": {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}}
        yield self.event("response.failed", response=body)

    def _grow(self, kind: str, text: str) -> Iterator[str]:
        if self.open is None or self.open.kind != kind:
            yield from self._close()
            yield from self._open(_OpenItem(kind, len(self.done)))
        item = self.open
        item.text += text
        where = {"item_id": item.id, "output_index": item.index}
        if kind != "function_call":
            where["content_index"] = 0
        yield self.event(_DELTA[kind], delta=text, **where, **({"logprobs": []} if kind == "message" else {}))

    def _open(self, item: _OpenItem) -> Iterator[str]:
        self.open = item
        added = {**item.item(), "status": "in_progress"}
        if item.kind != "function_call":
            added["content"] = []
        yield self.event("response.output_item.added", output_index=item.index, item=added)
        if item.kind != "function_call":
            yield self.event("response.content_part.added", item_id=item.id, output_index=item.index,
                             content_index=0, part=item.part())

    def _close(self) -> Iterator[str]:
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            yield self.event("response.function_call_arguments.done", arguments=item.text, name=item.name, **where)
        else:
            if item.kind == "reasoning":
                yield self.event("response.reasoning_text.done", text=item.text, content_index=0, **where)
            else:
                yield self.event("response.output_text.done", text=item.text, content_index=0, logprobs=[], **where)
            yield self.event("response.content_part.done", content_index=0, part=item.part(), **where)
        self.done.append(item.item())
        yield self.event("response.output_item.done", output_index=item.index, item=item.item())


async def response_events(serving: OpenAIServing, turn: ChatTurn, req: ResponsesRequest, response_id: str,
                          created_at: int) -> AsyncIterator[str]:
    events = ResponseEvents(req, response_id, created_at, serving.model_name)
    for event in events.start():
        yield event
    try:
        async with aclosing(chat_chunks(serving, turn)) as chunks:
            async for chunk in chunks:
                for event in events.chunk(chunk):
                    yield event
    except Exception as e:  # noqa: BLE001 - the status line is sent; the failure goes in the stream
        for event in events.fail(e):
            yield event
        return
    for event in events.finish():
        yield event
