"""What the OpenAI routes share: the served model, prompt tokenization and context checks, request
fields -> SamplingParams, and running several prompts through the engine (an AsyncEngine, or an
EngineClient whose engine runs in its own process) as one stream.

Everything that can be wrong with a request is found here, before the engine sees it, and raised
as a 400 APIError; leaving a stream early (a client disconnect cancels the handler) aborts every
engine request of the HTTP request, which frees their caches. Chat images and videos arrive as
base64 data: URLs (http(s) URLs only when the engine's MultiModalConfig allows remote URLs) and
are decoded and preprocessed here; a model without a vision tower refuses them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

import httpx

from k3ray.actors.openai.admission import Admission
from k3ray.actors.openai.errors import APIError, as_api_error, bad_request, from_value_error, log_failure
from k3ray.actors.openai.protocol import (
    MAX_SEQUENCES_PER_REQUEST,
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    SamplingFields,
)
from k3ray.actors.openai.choice_output import reads_output
from k3ray.actors.openai.tools import ToolPlan, tool_calls_error_message
from k3ray.engine.async_engine import AsyncEngine
from k3ray.engine.media.inputs import MediaInputError, media_parts, read_media
from k3ray.engine.outputs import FinishTally, OutputAccumulator, RequestOutput
from k3ray.engine.process.engine_client import EngineClient
from k3ray.engine.structured.structured_output import check_grammar  # xgrammar: loaded with the server
from k3ray.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams, XtmlMessage
from k3ray.tokenizer.chat import MEDIA_PART_KINDS, normalize_chat_role
from k3ray.tokenizer.chat_format import output_reasons
from k3ray.tokenizer.chat_options import ChatOptions
from k3ray.tokenizer.xtml_output import MESSAGE_END, xtml_marker_ids
from k3ray.vision import ProcessedMedia, expand_placeholders

AUDIO_PART_TYPES = ("input_audio", "audio_url")
PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
               "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logit_bias", "best_of", "structured_outputs", "response_format")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # one media placeholder per item of `media`
    text: str | None  # as the client sent it; None for token-id prompts
    media: tuple[ProcessedMedia, ...] = ()

    @property
    def num_tokens(self) -> int:
        """What the model sees: each placeholder expanded to its item's token count."""
        return len(self.ids) + sum(m.num_tokens - 1 for m in self.media)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine | EngineClient, tokenizer, model_name: str, metrics=None,
                 admission: Admission | None = None) -> None:
        self.engine = engine
        self.admission = admission
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.info = engine.info
        self.max_model_len: int = self.info.max_model_len
        self.vocab_size: int = self.info.vocab_size
        self.created = int(time.time())

    # models ------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "k3ray",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len,
                "chat_format": self.tokenizer.chat_format}

    def media_url_schemes(self) -> tuple[str, ...]:
        """The URL schemes a media part may use here: data, plus http(s) and file where allowed."""
        mm = self.info.multimodal if self.info.supports_media else None
        remote = ("http", "https") if mm is not None and mm.allow_remote_urls else ()
        local = ("file",) if mm is not None and mm.allowed_local_media_path else ()
        return ("data", *remote, *local)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")

    # prompts -----------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Special-token strings in the text become special ids, as Hugging Face tokenizers do."""
        return self.tokenizer.encode(text, allow_special=True)

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        ids = list(ids)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        return ids

    def completion_prompts(self, prompt) -> list[Prompt]:
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for item in prompt:
            if isinstance(item, str):
                out.append(Prompt(self.encode_text(item), item))
            else:
                out.append(Prompt(self.check_ids(item, "prompt"), None))
        return out

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool, tools: list[dict] | None = None,
                    options: ChatOptions | None = None) -> list[int]:
        """The ids the model sees (/tokenize): media placeholders expanded to their token counts."""
        dicts, ids = self._chat_ids(messages, add_generation_prompt, continue_final_message, tools, options)
        media = self._chat_media(dicts) if media_parts(dicts) else []  # a text-only model has no media config
        if not media:
            return ids
        placeholder = self.info.model_config.media_placeholder_token_id
        try:
            return expand_placeholders(ids, placeholder, [m.num_tokens for m in media]).token_ids
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    async def chat_input(self, messages: list[ChatMessage], add_generation_prompt: bool,
                         continue_final_message: bool, tools: list[dict] | None = None,
                         options: ChatOptions | None = None) -> Prompt:
        """Chat ids plus their images / videos, decoded and preprocessed off the event loop."""
        dicts, ids = self._chat_ids(messages, add_generation_prompt, continue_final_message, tools, options)
        media = await asyncio.to_thread(self._chat_media, dicts) if media_parts(dicts) else []
        return Prompt(ids, None, tuple(media))

    def _chat_ids(self, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                  tools: list[dict] | None, options: ChatOptions | None) -> tuple[list[dict], list[int]]:
        dicts = []
        for i, message in enumerate(messages):
            d = normalize_chat_role(message.model_dump(exclude_none=True))
            for j, part in enumerate(d.get("content") if isinstance(d.get("content"), list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in AUDIO_PART_TYPES or (kind in MEDIA_PART_KINDS and not self.info.supports_media):
                    what = "this model has no audio input" if kind in AUDIO_PART_TYPES else \
                        "this model has no vision tower"
                    raise bad_request(f"{kind} content parts are not supported: {what}; send text parts only",
                                      f"messages[{i}].content[{j}]", "unsupported_content")
            dicts.append(d)
        try:
            return dicts, self.tokenizer.encode_chat(dicts, add_generation_prompt, continue_final_message, tools,
                                                     options)
        except ValueError as e:
            raise bad_request(str(e), "messages") from e

    def _chat_media(self, dicts: list[dict]) -> list[ProcessedMedia]:
        mm = self.info.multimodal
        fetch = self._fetch if mm.allow_remote_urls else None
        try:
            return read_media(mm, dicts, fetch)
        except MediaInputError as e:
            raise bad_request(str(e), e.param, "invalid_media") from e

    def _fetch(self, url: str) -> bytes:
        """GET an http(s) media URL (only when the server allows remote media URLs)."""
        mm = self.info.multimodal
        limit = mm.media.max_input_bytes
        try:
            with httpx.stream("GET", url, timeout=mm.fetch_timeout_s, follow_redirects=True) as response:
                if response.status_code != 200:
                    raise ValueError(f"HTTP {response.status_code}")
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > limit:
                        raise ValueError(f"the body exceeds the limit of {limit} bytes")
                return bytes(data)
        except httpx.HTTPError as e:
            raise ValueError(f"{type(e).__name__}: {e}") from e

    def check_context(self, prompts: Sequence[Prompt], max_tokens: int | None, max_tokens_param: str = "max_tokens"
                      ) -> None:
        for p in prompts:
            if not p.ids:
                raise bad_request("the prompt is empty", "prompt")
            wanted = p.num_tokens + (max_tokens or 0)
            if p.num_tokens >= self.max_model_len or wanted > self.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{wanted} tokens ({p.num_tokens} in the prompt, {max_tokens or 0} for the completion). Please "
                    "reduce the length of the prompt or of the completion.",
                    # max_tokens that leave no room for any prompt are the field to fix
                    max_tokens_param if (max_tokens or 0) >= self.max_model_len else "prompt",
                    "context_length_exceeded")
        if self.admission is not None:  # a full queue answers 429 before a stream starts
            self.admission.check([p.num_tokens for p in prompts])

    # sampling ----------------------------------------------------------------------------------
    def sampling_params(self, req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, tools: ToolPlan | None = None,
                        thinking: bool | None = None) -> SamplingParams:
        """tools: a chat request's tool plan (its grammar, stop tokens); thinking: for a chat request,
        whether K3's prompt leaves its think channel open (its output is then read by its format's
        parser, from text with special tokens; None: no chat)."""
        _reject_unsupported(req)
        structured_outputs = _structured_outputs(req.response_format)
        stop_token_ids = tuple(req.stop_token_ids or ())
        stop = req.stop
        reads = thinking is not None and reads_output(self.tokenizer, tools)
        if tools is not None:
            structured_outputs = tools.structured_outputs or structured_outputs
            stop_token_ids += tuple(t for t in tools.stop_token_ids if t not in stop_token_ids)
            for extra in tools.stop:
                stop = _with_stop(stop, extra)
        if thinking is not None and output_reasons(self.tokenizer):
            stop = _with_stop(stop, MESSAGE_END)
            if structured_outputs is not None:  # the answer or the calls inside K3's message
                structured_outputs = replace(structured_outputs, xtml=XtmlMessage(xtml_marker_ids(self.tokenizer),
                                                                                  thinking))
        try:
            params = SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed,
                max_tokens=max_tokens,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens and not reads,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=req.logit_bias,
                best_of=getattr(req, "best_of", None),
                structured_outputs=structured_outputs,
                output_kind=RequestOutputKind.DELTA,  # streams send them on; run_to_end adds them up
            )
            grammar = params.structured_outputs
            params.validate(self.vocab_size, self.max_model_len, self.info.max_schema_bytes, schemas=grammar is None)
            if grammar is not None:  # its schemas checked here, once: one xgrammar refuses is a 400 before any stream
                check_grammar(grammar, self.info.max_schema_bytes)
        except ValueError as e:
            raise request_error(e) from e
        return params

    # running -----------------------------------------------------------------------------------
    def request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def generate(self, prompts: Sequence[Prompt], params: SamplingParams,
                       request_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, the engine's delta output) as any prompt advances; closing it aborts them all."""
        if len(prompts) * params.num_sequences > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(f"{len(prompts)} prompts x {params.num_sequences} samples (n or best_of) exceeds "
                              f"{MAX_SEQUENCES_PER_REQUEST} sequences per request", "prompt")
        started = time.monotonic()
        streams = [self.engine.generate(p.ids, params, f"{request_id}-{i}", media=p.media or None)
                   for i, p in enumerate(prompts)]
        unfinished = set(range(len(prompts)))
        tallies = [FinishTally() for _ in prompts]
        ticket = None if self.admission is None else self.admission.admit([p.num_tokens for p in prompts])
        try:
            async with aclosing(_merge(streams)) as merged:
                async for i, out in merged:
                    if ticket is not None:
                        self.admission.started(ticket)
                    tallies[i].add(out)
                    if out.finished:
                        unfinished.discard(i)
                        if self.metrics is not None:
                            self.metrics.observe_finished(tallies[i], out.metrics, time.monotonic() - started)
                    yield i, out
        finally:
            if ticket is not None:
                self.admission.finish(ticket)
            if unfinished and self.metrics is not None:
                self.metrics.observe_aborted(len(unfinished))

    async def run_to_end(self, prompts: Sequence[Prompt], params: SamplingParams,
                         request_id: str) -> list[RequestOutput]:
        """Each prompt's whole output, added up from its deltas."""
        finals: list[RequestOutput | None] = [None] * len(prompts)
        accumulators = [OutputAccumulator() for _ in prompts]
        try:
            async with aclosing(self.generate(prompts, params, request_id)) as outputs:
                async for i, out in outputs:
                    accumulators[i].add(out)
                    if out.finished:
                        finals[i] = accumulators[i].output()
        except ValueError as e:
            raise request_error(e) from e
        return finals  # type: ignore[return-value]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def stream_error(e: BaseException) -> str:
    log_failure(e)
    err = request_error(e) if isinstance(e, ValueError) else as_api_error(e)
    return sse(err.body())


def request_error(e: ValueError) -> APIError:
    """A ValueError about the request -> 400 naming its field; the engine's structured_outputs (a
    schema refused, or whose grammar could not be compiled) is the client's response_format."""
    error = from_value_error(e, PARAM_NAMES)
    if error.param == "structured_outputs" and str(e).startswith("structured_outputs.tool_calls"):
        return bad_request(tool_calls_error_message(str(e)), "tools")
    if error.param == "structured_outputs":
        return bad_request(str(e).replace("structured_outputs.json", "response_format.json_schema.schema", 1),
                           "response_format")
    return error


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")


def _with_stop(stop: str | list[str] | None, extra: str) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return stops if extra in stops else [*stops, extra]


def _reject_unsupported(req: SamplingFields) -> None:
    """Fields k3ray cannot honour fail loudly (as vLLM answers them) instead of being ignored."""
    if getattr(req, "suffix", None):
        raise bad_request("suffix is not supported: K3 is not trained to insert text before a suffix "
                          "(fill-in-the-middle)", "suffix", "unsupported_parameter")
    for field in ("tools", "tool_choice"):
        if not isinstance(req, ChatCompletionRequest) and getattr(req, field, None) is not None:
            raise bad_request(f"{field} is only for /v1/chat/completions: a completion is plain text",
                              field, "unsupported_parameter")


def _structured_outputs(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    """response_format -> the grammar the output must follow (None for plain text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    assert response_format.json_schema is not None and response_format.json_schema.json_schema is not None
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)


async def _merge(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
