"""POST /v1/chat/completions: K3's chat template (continuing a trailing assistant message with
`continue_final_message`), image and video parts, tools (openai/tools.py: calls in the message, or
streamed as `delta.tool_calls`), n choices, chat-format logprobs and SSE streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from k3ray.actors.openai.errors import bad_request
from k3ray.actors.openai.logprobs import chat_logprobs
from k3ray.actors.openai.protocol import ChatCompletionRequest
from k3ray.actors.openai.serving import OpenAIServing, check_stream_options, sse, stream_error, usage
from k3ray.actors.openai.tools import ChoiceTools, ToolPlan, tool_plan
from k3ray.engine.outputs import CompletionOutput
from k3ray.sampling_params import MAX_LOGPROBS


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
    serving.check_model(req.model)
    check_stream_options(req)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    if top and not req.logprobs:  # 0 asks for nothing: accepted without logprobs, as by vLLM
        raise bad_request(f"top_logprobs={top} needs logprobs=true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tools = tool_plan(req, serving.tokenizer, serving.info.max_schema_bytes)
    prompt = await serving.chat_input(req.messages, req.add_generation_prompt, req.continue_final_message,
                                      tools.tools if tools is not None else None)
    serving.check_context([prompt], max_tokens,
                          "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=(top or 0) if req.logprobs else None,
                                     tools=tools)
    request_id = serving.request_id("chatcmpl")
    if req.stream:
        return _stream(serving, req, prompt, params, request_id, tools)
    (final,) = await serving.run_to_end([prompt], params, request_id)
    choices = []
    for c in final.outputs:
        message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
        if tools is not None and tools.parse:
            message, finish_reason = _choice_tools(serving, req, tools).message(c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": _logprobs(serving, req, c),
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": serving.model_name, "choices": choices,
            "usage": usage(prompt.num_tokens, sum(len(c.token_ids) for c in final.outputs))}


def _logprobs(serving: OpenAIServing, req: ChatCompletionRequest, c: CompletionOutput) -> dict | None:
    if not req.logprobs:
        return None
    return {"content": chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs or [], req.top_logprobs or 0)}


def _choice_tools(serving: OpenAIServing, req: ChatCompletionRequest, tools: ToolPlan) -> ChoiceTools:
    return ChoiceTools(tools, serving.tokenizer, req.skip_special_tokens)


async def _stream(serving, req, prompt, params, request_id, tools: ToolPlan | None) -> AsyncIterator[str]:
    """The engine's deltas, each sent on as it comes: the work per chunk is that of its new tokens."""
    created = int(time.time())
    completion_tokens = 0
    parsers = [_choice_tools(serving, req, tools) for _ in range(params.n)] if tools is not None and tools.parse \
        else None

    def chunk(choices: list[dict]) -> str:
        return sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": serving.model_name, "choices": choices})

    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(params.n)])
        async with aclosing(serving.generate([prompt], params, request_id)) as outputs:
            async for _, out in outputs:
                choices = []
                for c in out.outputs:
                    delta = {"content": c.text} if c.text else {}
                    finish_reason = c.finish_reason if c.finished else None
                    if parsers is not None:
                        delta, finish_reason = parsers[c.index].delta(c.text, c.finished, c.finish_reason)
                    if delta or c.token_ids or c.finished:
                        choices.append({"index": c.index, "delta": delta,
                                        "logprobs": _logprobs(serving, req, c) if c.token_ids else None,
                                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
                    completion_tokens += len(c.token_ids)
                if choices:
                    yield chunk(choices)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": serving.model_name, "choices": [], "usage": usage(prompt.num_tokens, completion_tokens)})
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield stream_error(e)
    yield sse("[DONE]")
