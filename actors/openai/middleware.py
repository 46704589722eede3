"""ASGI middleware in front of the OpenAI routes: an optional API key and a request-body limit,
both answering with OpenAI error JSON."""

from __future__ import annotations

import hmac

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from k3ray.actors.openai.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapers carry no key


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`) on every route but the open
    ones, else 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").strip().partition(b" ")
        # the scheme is case-insensitive (RFC 9110): `bearer KEY` is as good as `Bearer KEY`
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)
        if not bearer and not hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.expected):
            err = APIError(401, "Missing or invalid API key: send `Authorization: Bearer <key>` or "
                           "`x-api-key: <key>`.", None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Requests whose body exceeds max_bytes get 413: at once from Content-Length, or while the
    body streams in (chunked uploads)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> str:
        return f"the request body ({size}) exceeds the limit of {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            size = f"{int(length)} bytes" if length.isdigit() else f"Content-Length {length[:32]!r}"
            status = 413 if length.isdigit() else 400
            await APIError(status, self._too_large(size) if status == 413 else f"invalid {size}", None,
                           "request_too_large" if status == 413 else None).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # an HTTPException passes FastAPI's body parsing untouched and reaches our handler
                    raise HTTPException(413, self._too_large(f"over {self.max_bytes} bytes"))
            return message

        await self.app(scope, limited_receive, send)


def route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve's route_prefix arrives as root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path
