"""POST /v1/responses: OpenAI's Responses API, stateless, on the chat path.

The request becomes a chat request and runs as one chat turn (openai/chat.py); its chat.completion
becomes a Response, or its chunks the Responses events (openai/responses_stream.py). Nothing is
stored: the whole conversation comes in `input` (openai/responses_convert.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from k3ray.actors.openai.chat import chat_response, prepare_chat
from k3ray.actors.openai.errors import APIError
from k3ray.actors.openai.responses_convert import chat_request, response_body, responses_error
from k3ray.actors.openai.responses_protocol import ResponsesRequest
from k3ray.actors.openai.responses_stream import response_events
from k3ray.actors.openai.serving import OpenAIServing


async def create_response(serving: OpenAIServing, req: ResponsesRequest) -> dict | AsyncIterator[str]:
    chat = chat_request(req)
    try:
        turn = await prepare_chat(serving, chat, id_prefix="resp")
    except APIError as e:
        raise responses_error(e) from e
    response_id, created_at = _response_id(turn.request_id), int(time.time())
    if req.stream:
        return response_events(serving, turn, req, response_id, created_at)
    return response_body(req, await chat_response(serving, turn), response_id, created_at, serving.model_name)


def _response_id(request_id: str) -> str:
    return "resp_" + request_id.rsplit("-", 1)[-1]
