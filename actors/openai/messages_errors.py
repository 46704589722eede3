"""Anthropic's error shape, {"type": "error", "error": {"type", "message"}}, for every failure under
/v1/messages: the app's OpenAI error answers (validation, API key, body limit, 503, ...) rewritten
on the way out, and a stream's error event."""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from k3ray.actors.openai.errors import ERROR_RESPONSES, APIError
from k3ray.actors.openai.messages_protocol import MessagesRequest
from k3ray.actors.openai.middleware import route_path

MESSAGES_PATH = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """The body of every error answer under /v1/messages."""

    type: Literal["error"]
    error: AnthropicErrorDetail


MESSAGES_ERROR_RESPONSES: dict[int | str, dict] = {
    status: {**answer, "model": AnthropicErrorBody} for status, answer in ERROR_RESPONSES.items()}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def api_error_body(err: APIError) -> dict:
    return error_body(err.status, err.message)


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicErrorMiddleware:
    """Rewrites the OpenAI error body of any answer of 400 or more under /v1/messages (outermost, so
    that the API key's 401 and the body limit's 413 are rewritten too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(route_path(scope)):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def rewriting_send(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            new = json.dumps(error_body(start["status"], _message_of(body))).encode()
            headers = [(k, v) for k, v in start.get("headers", [])
                       if k.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(new)).encode())]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, rewriting_send)


def _message_of(body: bytes) -> str:
    """The message of an OpenAI error body (or the body's text, if it is none), led by the field it
    names when that is a Messages field (Anthropic's error has no param)."""
    try:
        error = json.loads(body)["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:1000]
    field = re.match(r"\w*", param).group() if isinstance(param, str) else ""
    return f"{param}: {message}" if field in MessagesRequest.model_fields and not message.startswith(param) else message
