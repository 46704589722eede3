"""The FastAPI app of one replica: OpenAI routes, Anthropic's /v1/messages, vLLM's tokenizer routes,
/health and /metrics.

    app = build_openai_app(serving, metrics=ServeMetrics(...), health=check, api_key="...")

It is a plain ASGI app (Serve's ingress wraps it; tests can also drive it in-process).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from k3ray.actors.openai.chat import create_chat_completion
from k3ray.actors.openai.choice_output import chat_options
from k3ray.actors.openai.completions import create_completion
from k3ray.actors.openai.errors import ERROR_RESPONSES, APIError, bad_request, install_error_handlers
from k3ray.actors.openai.limits import DEFAULT_MAX_BODY_BYTES
from k3ray.actors.openai.messages import count_tokens, create_message
from k3ray.actors.openai.messages_errors import MESSAGES_ERROR_RESPONSES, AnthropicErrorMiddleware
from k3ray.actors.openai.messages_protocol import CountTokensRequest, MessagesRequest
from k3ray.actors.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware
from k3ray.actors.openai.protocol import (
    SERVED_MODEL,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from k3ray.actors.openai.responses import create_response
from k3ray.actors.openai.responses_protocol import ResponsesRequest
from k3ray.actors.openai.schema import ServerLimits, openapi_document
from k3ray.actors.openai.serving import OpenAIServing

HealthCheck = Callable[[], Awaitable[tuple[bool, str]]]


def build_openai_app(serving: OpenAIServing, *, metrics=None, health: HealthCheck | None = None,
                     api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     retry_after_s: float = 1.0) -> FastAPI:
    app = FastAPI(title="k3ray", description="OpenAI-compatible API for Kimi K3 on Ray Serve",
                  responses=ERROR_RESPONSES)
    limits = ServerLimits(serving.model_name, serving.vocab_size, serving.max_model_len,
                          serving.info.supports_media, bool(api_key), serving.media_url_schemes())
    app.openapi = functools.partial(openapi_document, app, limits)
    install_error_handlers(app, retry_after_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: /v1/messages answers every error in its shape

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [serving.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: Annotated[str, Path(json_schema_extra=SERVED_MODEL)]) -> dict:
        serving.check_model(model)
        return serving.model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await _unless_disconnected(request, create_completion(serving, req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await _unless_disconnected(request, create_chat_completion(serving, req))

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        return await _unless_disconnected(request, create_response(serving, req))

    @app.post("/v1/messages", responses=MESSAGES_ERROR_RESPONSES)
    async def messages(req: MessagesRequest, request: Request) -> Response:
        return await _unless_disconnected(request, create_message(serving, req))

    @app.post("/v1/messages/count_tokens", responses=MESSAGES_ERROR_RESPONSES)
    async def messages_count_tokens(req: CountTokensRequest) -> dict:
        return await count_tokens(serving, req)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ids = serving.encode_text(req.prompt)
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message, tools,
                                      chat_options(req, serving.tokenizer))
        body = {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = serving.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        serving.check_model(req.model)
        ids = serving.check_ids(req.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(ids)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        tok = serving.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "name": tok.name,
            "vocab_size": tok.vocab_size,
            "bos_token": tok.convert_ids_to_tokens([tok.bos_token_id])[0],
            "eos_token": tok.convert_ids_to_tokens([tok.eos_token_id])[0],
            "pad_token": tok.convert_ids_to_tokens([tok.pad_token_id])[0],
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "stop_token_ids": sorted(tok.stop_token_ids),
            "chat_template": tok.chat_template,
            "chat_format": tok.chat_format,
            "special_tokens": {name: token_id for name, token_id in tok.special_tokens.items()
                               if not name.startswith("<|reserved_token_")},
            "model_max_length": serving.max_model_len,
            "add_bos_token": False,
        }

    @app.get("/health")
    @app.get("/ready")  # the replica answers once it is up (HAProxy answers both before that)
    async def health_route() -> Response:
        ok, detail = (True, "") if health is None else await health()
        if not ok:
            raise APIError(503, f"unhealthy: {detail}", None, "model_unavailable", {"Retry-After": "1"})
        return Response("ok", media_type="text/plain")

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:
            raise APIError(404, "metrics are not enabled")
        text, content_type = await metrics.render()
        return Response(text, media_type=content_type)

    return app


CLIENT_CLOSED = 499  # nginx's status for a client that left before the reply; nobody receives it


async def _unless_disconnected(request: Request, work: Awaitable[dict | AsyncIterator[str]]) -> Response:
    """The response of `work`, which is cancelled (its engine requests aborted) if the client
    disconnects first. A stream notices a disconnect by itself and Serve's proxy cancels the
    handler, but a replica's own HTTP server (haproxy ingress) leaves a plain request running."""
    work = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)  # let its cleanup (the abort) run
        return Response(status_code=CLIENT_CLOSED)
    return _respond(work.result())


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _respond(result: dict | AsyncIterator[str]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
