"""A `Target` over an in-process engine: the same prompts, tokens and greedy answers as k3ray's
OpenAI server gives for the same checkpoint, without HTTP.

    target = EngineTarget(LLM("path/to/checkpoint"))
    run_eval(config, target, "out/", ...)   # with executor="threads": the engine lives here

Text prompts are encoded as the server's /tokenize and /v1/completions encode them (special-token
strings become special ids); chat prompts go through the tokenizer's chat template with a
generation prompt, as /v1/chat/completions does; their image_url / video_url parts go to the
engine's vision tower when the checkpoint has one, read under the engine's media settings as the
server reads them. Calls from several threads share the engine: each waiting caller steps it in
turn, so concurrent cells are batched together; a step that fails fails every call in it with the
cause.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from k3ray.engine.llm import LLM
from k3ray.engine.llm_engine import LLMEngine
from k3ray.engine.media.inputs import media_parts, read_media
from k3ray.engine.outputs import RequestOutput
from k3ray.engine.step_or_abort import step_or_abort
from k3ray.evals.target import Prompt
from k3ray.sampling_params import RequestOutputKind, SamplingParams
from k3ray.tokenizer.chat import normalize_chat_role
from k3ray.tokenizer.chat_format import JINJA, output_reasons
from k3ray.tokenizer.chat_options import options_from_kwargs
from k3ray.tokenizer.tool_calls import SpecialTokens
from k3ray.tokenizer.xtml_output import MESSAGE_END, XtmlOutputParser
from k3ray.vision import ProcessedMedia
from k3ray.vision.placeholders import expand_placeholders

AUDIO_PART_TYPES = ("input_audio", "audio_url")


class EngineTarget:
    def __init__(self, engine: LLM | LLMEngine, tokenizer=None, *, name: str | None = None,
                 max_context: int | None = None, chat_template_kwargs: dict | None = None) -> None:
        """chat_template_kwargs: how chat prompts render (K3's thinking and its effort), as the chat route takes them."""
        llm_engine = engine.engine if isinstance(engine, LLM) else engine
        if not isinstance(llm_engine, LLMEngine):
            raise ValueError(f"engine must be an LLM or an LLMEngine, got {type(engine).__name__}")
        tokenizer = llm_engine.tokenizer if tokenizer is None else tokenizer
        if tokenizer is None:
            raise ValueError("the engine has no tokenizer; pass tokenizer= (the checkpoint's tokenizer)")
        if max_context is not None and not 1 < max_context <= llm_engine.max_model_len:
            raise ValueError(f"max_context must be in [2, {llm_engine.max_model_len}] (the engine's "
                             f"max_model_len), got {max_context}")
        self.engine = llm_engine
        self.tokenizer = tokenizer
        self.chat_options = options_from_kwargs(chat_template_kwargs, any_kwargs=tokenizer.chat_format == JINJA)
        self.max_context = max_context or llm_engine.max_model_len
        self.name = name or f"engine:{llm_engine.model_config.name}"
        self._lock = threading.Lock()
        self._finished: dict[str, RequestOutput] = {}
        self._failed: dict[str, Exception] = {}  # requests a failed step took down -> its error
        self._ids = itertools.count()

    def __reduce__(self):
        raise TypeError("EngineTarget holds an in-process engine and cannot be sent to another process; "
                        "run the eval with executor='threads'")

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allow_special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def tokens_computed(self) -> int:
        """Prompt tokens computed or found in the prefix cache, and tokens generated, so far (read
        from another thread while this one steps: each is one int)."""
        stats = self.engine.stats
        return stats.prompt_tokens + stats.generation_tokens + self.engine.cache.prefix_hits

    def prompt_inputs(self, prompt: Prompt) -> tuple[list[int], list[ProcessedMedia] | None]:
        """(prompt ids, their images and videos decoded and preprocessed, or None without any)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt), None
        messages = []
        for i, message in enumerate(prompt):
            message = normalize_chat_role(message)
            content = message.get("content")
            for part in content if isinstance(content, list) else []:
                if isinstance(part, dict) and part.get("type") in AUDIO_PART_TYPES:
                    raise ValueError(f"messages[{i}] has a {part['type']} part: k3ray's models take no audio")
            messages.append(message)
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True, continue_final_message=False,
                                         options=self.chat_options)
        if not media_parts(messages):
            return ids, None
        if not self.engine.supports_media:
            raise ValueError(f"the prompt holds images or videos but {self.name} has no vision tower")
        return ids, read_media(self.engine.multimodal, messages)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The ids the model sees, media placeholders expanded to their token counts (as /tokenize)."""
        ids, media = self.prompt_inputs(prompt)
        if not media:
            return ids
        placeholder = self.engine.model_config.media_placeholder_token_id
        return expand_placeholders(ids, placeholder, [m.num_tokens for m in media]).token_ids

    def count_chat_tokens(self, messages: list[dict[str, Any]]) -> int:
        """The chat prompt's tokens as /v1/chat/completions encodes it (media tokens included)."""
        return len(self.prompt_ids(messages))

    def complete(self, prompt: Prompt, max_tokens: int) -> str:
        """The greedy completion of `prompt`, at most `max_tokens` tokens (EOS and stop tokens end it)."""
        ids, media = self.prompt_inputs(prompt)
        length = len(ids) + sum(m.num_tokens - 1 for m in media or ())  # each placeholder becomes num_tokens
        if length + max_tokens > self.max_context:
            raise ValueError(f"the prompt has {length} tokens; with max_tokens={max_tokens} it needs "
                             f"{length + max_tokens}, more than max_context={self.max_context}")
        if isinstance(prompt, str) or not output_reasons(self.tokenizer):
            return self.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), media).outputs[0].text
        # K3's chat output: its response channel is the answer, as the chat route's `content` (never the thinking)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, skip_special_tokens=False, stop=[MESSAGE_END])
        text = self.generate(ids, params, media).outputs[0].text
        thinking = self.chat_options.thinking_on()
        return XtmlOutputParser.parse(text, specials=SpecialTokens.of(self.tokenizer), thinking=thinking).content

    def generate(self, ids: Sequence[int], params: SamplingParams,
                 media: Sequence[ProcessedMedia] | None = None) -> RequestOutput:
        """Run one request to its end, batched with whatever other threads are running."""
        request_id = f"target-{next(self._ids)}"
        with self._lock:  # only the final output is kept: the engine builds no other
            self.engine.add_request(request_id, list(ids), replace(params, output_kind=RequestOutputKind.FINAL_ONLY),
                                    media=media)
        while True:
            with self._lock:
                if request_id in self._finished:
                    return self._finished.pop(request_id)
                if request_id in self._failed:
                    raise self._failed.pop(request_id)
                step = step_or_abort(self.engine)
                for out in step.outputs:
                    if out.finished:
                        self._finished[out.request_id] = out
                for failed_id in step.aborted:
                    self._failed[failed_id] = step.error
