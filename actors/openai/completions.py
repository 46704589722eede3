"""POST /v1/completions: text or token-id prompts (one or a batch), n samples each, echo, legacy
logprobs over the echoed prompt and the completion (lm-eval's loglikelihood requests:
`echo: true, max_tokens: 0 or 1, logprobs: 1`; max_tokens 0 without echo is an empty text, as OpenAI's
minimum of 0 allows), and SSE streaming."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from k3ray.actors.openai.errors import bad_request
from k3ray.actors.openai.logprobs import CompletionLogprobs, merge_blocks, prompt_logprobs_field
from k3ray.actors.openai.protocol import CompletionRequest
from k3ray.actors.openai.serving import (
    OpenAIServing,
    Prompt,
    check_stream_options,
    sse,
    stream_error,
    usage,
)
from k3ray.engine.outputs import CompletionOutput, RequestOutput


class _Choice:
    """One choice of the response: its echo still to send, its logprobs accumulator, tokens generated."""

    def __init__(self, serving: OpenAIServing, req: CompletionRequest, prompt: Prompt, index: int) -> None:
        self.index = index
        self.tokens_generated = 0
        self.echo_pending = req.echo
        self.logprobs = (CompletionLogprobs(serving.tokenizer, req.skip_special_tokens)
                         if req.logprobs is not None else None)
        self.echo_text = "" if not req.echo else (
            prompt.text if prompt.text is not None else serving.tokenizer.decode(prompt.ids))

    def delta(self, out: RequestOutput, prompt_logprobs: list | None, c: CompletionOutput,
              keep_generated: bool) -> tuple[str, dict | None]:
        """Text and logprobs for `c`, the choice's new output (the echoed prompt first, with the
        prompt's logprobs so far, on the choice's first call)."""
        text, block = "", None
        if self.echo_pending:
            self.echo_pending = False
            text = self.echo_text
            if self.logprobs is not None:
                entries = prompt_logprobs or [None] * len(out.prompt_token_ids)
                block = self.logprobs.add_prompt(out.prompt_token_ids, entries)
        if keep_generated:
            text += c.text
            if self.logprobs is not None and c.token_ids:
                block = merge_blocks(block, self.logprobs.add(c.token_ids, c.logprobs or []))
        self.tokens_generated += len(c.token_ids)
        if self.logprobs is not None and block is None:
            block = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return text, block


async def create_completion(serving: OpenAIServing, req: CompletionRequest) -> dict | AsyncIterator[str]:
    serving.check_model(req.model)
    check_stream_options(req)
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise bad_request("best_of > n cannot be streamed: the best completions are known only at the end", "best_of")
    prompts = serving.completion_prompts(req.prompt)
    # max_tokens 0 (the echoed prompt, its logprobs, or nothing) still runs one decode step in the
    # engine; its token is dropped
    keep_generated = req.max_tokens != 0
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
    serving.check_context(prompts, max_tokens)
    wants_prompt_logprobs = req.echo and req.logprobs is not None
    prompt_logprobs = req.prompt_logprobs
    if wants_prompt_logprobs:
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                     prompt_logprobs=prompt_logprobs)
    request_id = serving.request_id("cmpl")
    choices = [[_Choice(serving, req, p, i * req.n + j) for j in range(req.n)] for i, p in enumerate(prompts)]
    if req.stream:
        return _stream(serving, req, prompts, params, request_id, choices, keep_generated)
    finals = await serving.run_to_end(prompts, params, request_id)
    body_choices = []
    for i, out in enumerate(finals):
        for c in out.outputs:
            choice = choices[i][c.index]
            text, block = choice.delta(out, out.prompt_logprobs, c, keep_generated)
            entry = {"index": choice.index, "text": text, "logprobs": block,
                     "finish_reason": _finish(c, keep_generated), "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                entry["prompt_logprobs"] = prompt_logprobs_field(serving.tokenizer, out.prompt_token_ids,
                                                                 out.prompt_logprobs or [])
            body_choices.append(entry)
    _discard_echo_step(serving, choices, keep_generated)
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": serving.model_name,
        "choices": body_choices,
        "usage": usage(sum(len(p.ids) for p in prompts), _completion_tokens(choices, keep_generated)),
    }


async def _stream(serving, req, prompts, params, request_id, choices, keep_generated) -> AsyncIterator[str]:
    """The engine's deltas, each sent on as it comes: the work per chunk is that of its new tokens."""
    created = int(time.time())
    prompt_logprobs: list[list | None] = [None] * len(prompts)  # each prompt's, as they arrive

    def chunk(entries: list[dict]) -> str:
        return sse({"id": request_id, "object": "text_completion", "created": created,
                    "model": serving.model_name, "choices": entries})

    try:
        async with aclosing(serving.generate(prompts, params, request_id)) as outputs:
            async for i, out in outputs:
                if out.prompt_logprobs:
                    prompt_logprobs[i] = (prompt_logprobs[i] or []) + out.prompt_logprobs  # the first delta's
                entries = []
                for c in out.outputs:
                    choice = choices[i][c.index]
                    text, block = choice.delta(out, prompt_logprobs[i], c, keep_generated)
                    if text or (block and block["tokens"]) or c.finished:
                        entries.append({"index": choice.index, "text": text, "logprobs": block,
                                        "finish_reason": _finish(c, keep_generated) if c.finished else None,
                                        "stop_reason": c.stop_reason})
                if entries:
                    yield chunk(entries)
        _discard_echo_step(serving, choices, keep_generated)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": serving.model_name, "choices": [],
                       "usage": usage(sum(len(p.ids) for p in prompts), _completion_tokens(choices, keep_generated))})
    except Exception as e:  # noqa: BLE001 - the status line is sent; the error goes in the stream
        yield stream_error(e)
    yield sse("[DONE]")


def _finish(c: CompletionOutput, keep_generated: bool) -> str | None:
    return c.finish_reason if keep_generated else "length"


def _completion_tokens(choices: list[list[_Choice]], keep_generated: bool) -> int:
    return _generated_tokens(choices) if keep_generated else 0


def _generated_tokens(choices: list[list[_Choice]]) -> int:
    return sum(choice.tokens_generated for per_prompt in choices for choice in per_prompt)


def _discard_echo_step(serving: OpenAIServing, choices: list[list[_Choice]], keep_generated: bool) -> None:
    """An echo-only request's decode step is not generation the client sees: the metrics say so too."""
    if not keep_generated and serving.metrics is not None:
        serving.metrics.observe_discarded(_generated_tokens(choices))
