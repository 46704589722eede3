"""POST /v1/chat/completions: the checkpoint's chat format (k3ray.tokenizer.chat_format: K3's XTML,
Kimi K2's, or a shipped Jinja template), thinking on or off, image and video parts, tools
(openai/tools.py), the output read for reasoning, content and tool calls (openai/choice_output.py),
n choices, chat-format logprobs and SSE streaming.

The turn is built once (`prepare_chat`) and answered whole (`chat_response`) or as chunk dicts
(`chat_chunks`); /v1/responses and /v1/messages translate their requests into a chat request and
their answers from these, so every API reads the model's output the same way.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from k3ray.actors.openai.choice_output import ChoiceOutput, chat_options, starts_thinking
from k3ray.actors.openai.errors import bad_request
from k3ray.actors.openai.logprobs import chat_logprobs
from k3ray.actors.openai.protocol import ChatCompletionRequest
from k3ray.actors.openai.serving import OpenAIServing, Prompt, check_stream_options, sse, stream_error, usage
from k3ray.actors.openai.tools import ToolPlan, tool_plan
from k3ray.engine.outputs import CompletionOutput
from k3ray.sampling_params import MAX_LOGPROBS, SamplingParams
from k3ray.tokenizer.chat_format import ChatOptions


@dataclass(frozen=True)
class ChatTurn:
    """One chat request, checked and rendered: what the engine runs and how its output is read."""

    req: ChatCompletionRequest
    prompt: Prompt
    params: SamplingParams
    request_id: str
    tools: ToolPlan | None
    options: ChatOptions

    def choice_output(self, serving: OpenAIServing) -> ChoiceOutput:
        return ChoiceOutput(serving.tokenizer, self.options, self.tools, self.req.skip_special_tokens,
                            starts_thinking(self.req, self.options))


async def create_chat_completion(serving: OpenAIServing, req: ChatCompletionRequest) -> dict | AsyncIterator[str]:
    turn = await prepare_chat(serving, req)
    if req.stream:
        return _sse(serving, turn)
    return await chat_response(serving, turn)


async def prepare_chat(serving: OpenAIServing, req: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> ChatTurn:
    """Check req, render its prompt and build its sampling (an APIError, 400 naming the field, if bad)."""
    serving.check_model(req.model)
    check_stream_options(req)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    for legacy, modern in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, legacy) is not None:
            raise bad_request(f"{legacy} is OpenAI's deprecated form of {modern}: send {modern} instead", legacy,
                              "unsupported_parameter")
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    if top and not req.logprobs:  # 0 asks for nothing: accepted without logprobs, as by vLLM
        raise bad_request(f"top_logprobs={top} needs logprobs=true", "top_logprobs")
    if req.max_completion_tokens is not None and req.max_tokens is not None and req.max_tokens >= serving.max_model_len:
        # the field not used is still held to the context, as the one used is
        raise bad_request(f"max_tokens must be below the context length ({serving.max_model_len}), got "
                          f"{req.max_tokens}", "max_tokens", "context_length_exceeded")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    options = chat_options(req, serving.tokenizer)
    tools = tool_plan(req, serving.tokenizer, serving.info.max_schema_bytes)
    prompt = await serving.chat_input(req.messages, req.add_generation_prompt, req.continue_final_message,
                                      tools.tools if tools is not None else None, options)
    serving.check_context([prompt], max_tokens,
                          "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=(top or 0) if req.logprobs else None,
                                     tools=tools, thinking=starts_thinking(req, options))
    return ChatTurn(req, prompt, params, serving.request_id(id_prefix), tools, options)


async def chat_response(serving: OpenAIServing, turn: ChatTurn) -> dict:
    """The whole chat.completion body."""
    (final,) = await serving.run_to_end([turn.prompt], turn.params, turn.request_id)
    choices = []
    for c in final.outputs:
        message, finish_reason = turn.choice_output(serving).message(c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message, "logprobs": _logprobs(serving, turn.req, c),
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return {"id": turn.request_id, "object": "chat.completion", "created": int(time.time()),
            "model": serving.model_name, "choices": choices,
            "usage": usage(turn.prompt.num_tokens, sum(len(c.token_ids) for c in final.outputs))}


def _logprobs(serving: OpenAIServing, req: ChatCompletionRequest, c: CompletionOutput) -> dict | None:
    if not req.logprobs:
        return None
    return {"content": chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs or [], req.top_logprobs or 0)}


async def chat_chunks(serving: OpenAIServing, turn: ChatTurn) -> AsyncIterator[dict]:
    """The engine's deltas as chat.completion.chunk dicts, each sent on as it comes (the work per
    chunk is that of its new tokens); the last has the usage when `usage_chunk`. Errors raise."""
    req, created, completion_tokens = turn.req, int(time.time()), 0
    outputs = [turn.choice_output(serving) for _ in range(turn.params.n)]

    def chunk(choices: list[dict]) -> dict:
        return {"id": turn.request_id, "object": "chat.completion.chunk", "created": created,
                "model": serving.model_name, "choices": choices}

    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(turn.params.n)])
    async with aclosing(serving.generate([turn.prompt], turn.params, turn.request_id)) as stream:
        async for _, out in stream:
            choices = []
            for c in out.outputs:
                delta, finish_reason = outputs[c.index].delta(c.text, c.finished, c.finish_reason)
                if delta or c.token_ids or c.finished:
                    choices.append({"index": c.index, "delta": delta,
                                    "logprobs": _logprobs(serving, req, c) if c.token_ids else None,
                                    "finish_reason": finish_reason, "stop_reason": c.stop_reason})
                completion_tokens += len(c.token_ids)
            if choices:
                yield chunk(choices)
    final = chunk([])
    final["usage"] = usage(turn.prompt.num_tokens, completion_tokens)
    yield final


async def _sse(serving: OpenAIServing, turn: ChatTurn) -> AsyncIterator[str]:
    include_usage = turn.req.stream_options is not None and turn.req.stream_options.include_usage
    try:
        async with aclosing(chat_chunks(serving, turn)) as chunks:
            async for chunk in chunks:
                if chunk["choices"] or include_usage:
                    yield sse(chunk)
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield stream_error(e)
    yield sse("[DONE]")
