"""`LLM`: vLLM's offline interface over the engine and an in-process model.

    llm = LLM()                                   # the default tiny K3 checkpoint
    llm = LLM("path/to/checkpoint")               # any K3-shaped checkpoint directory
    llm = LLM("path/to/checkpoint", device="cuda:1", enforce_eager=True)  # no CUDA graphs
    llm = LLM(build_model(preset("k3-tiny")), tokenizer=ByteTokenizer())
    outs = llm.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=16))

Media prompts (a checkpoint with a vision tower, or `vision=`), as vLLM takes them, or as chat:
    llm.generate({"prompt": "<|media_start|>image<|media_content|><|kimi_image_placeholder|><|media_end|>What?",
                  "multi_modal_data": {"image": [png_bytes]}})
    llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                                           {"type": "text", "text": "What is this?"}]}])
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from k3ray.default_model import checkpoint_dir
from k3ray.device import DeviceLike, resolve_device
from k3ray.engine.config import EngineConfig, MultiModalConfig, SpeculativeConfig
from k3ray.engine.execution.executor import LocalExecutor
from k3ray.engine.llm_engine import LLMEngine
from k3ray.engine.media.prompt_media import VisionEncoderFn, local_vision_encoder
from k3ray.engine.media.inputs import (
    load_media_config,
    media_from_multi_modal_data,
    media_parts,
    read_media,
)
from k3ray.engine.outputs import RequestOutput
from k3ray.engine.stats import EngineStats
from k3ray.models.k3 import K3ForCausalLM
from k3ray.sampling_params import RequestOutputKind, SamplingParams
from k3ray.tokenizer.chat_format import JINJA
from k3ray.tokenizer.chat_options import options_from_kwargs
from k3ray.tokenizer.load import tokenizer_for
from k3ray.vision import K3VisionModel, MediaConfig, ProcessedMedia, has_vision_weights, load_vision
from k3ray.weights.loader import load_model

PromptType = str | Seq[int] | dict


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | K3ForCausalLM | None = None,
        tokenizer=None,
        *,
        vision: K3VisionModel | VisionEncoderFn | None = None,
        multimodal: MultiModalConfig | None = None,
        draft_model: str | os.PathLike | K3ForCausalLM | None = None,
        speculative: SpeculativeConfig | None = None,
        dtype: torch.dtype = torch.float32,
        device: DeviceLike = None,
        **engine_options,
    ) -> None:
        """engine_options are EngineConfig fields (max_num_seqs, block_size, num_blocks, enforce_eager,
        ...). `device` ("auto", "cpu", "cuda", "cuda:N"; None: "auto" for a checkpoint, where a given
        model already is for a K3ForCausalLM) holds the model, its caches and sampling. `vision` (a
        K3VisionModel or an encoder callable) enables media prompts; a checkpoint directory brings
        its own vision tower and preprocessor_config.json when it has them. `tokenizer`: a Tokenizer,
        or a directory holding one (default: the checkpoint's own)."""
        path = None if isinstance(model, K3ForCausalLM) else _checkpoint_dir(model)
        if device is None:
            device = next(model.parameters()).device if path is None else "auto"
        device = resolve_device(device)
        model, tokenizer = _load(model if path is None else path, dtype, device, tokenizer)
        draft = None if draft_model is None else _load(draft_model, dtype, device)[0]
        if draft is not None and speculative is None:
            speculative = SpeculativeConfig(method="draft")
        config = EngineConfig(speculative=speculative, **engine_options)
        multimodal = multimodal or MultiModalConfig()
        tower = model.config.vision
        if vision is None and path is not None and tower is not None and has_vision_weights(path):
            vision = load_vision(path, dtype, device)
        elif isinstance(vision, K3VisionModel):
            vision = vision.to(device)
        if vision is not None and path is not None and tower is not None and multimodal.media is None:
            multimodal = replace(multimodal, media=load_media_config(path, tower))
        encoder = local_vision_encoder(vision) if isinstance(vision, K3VisionModel) else vision
        self.engine = LLMEngine(LocalExecutor(model, draft), config, tokenizer, vision_encoder=encoder,
                                multimodal=multimodal)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order. A prompt is text, token
        ids, or a dict with "prompt" / "prompt_token_ids" and optionally "multi_modal_data"."""
        return self._run([self._prompt_inputs(p) for p in _prompt_list(prompts)], sampling_params)

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: Seq[dict] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of OpenAI-style messages) or a list of them, through the
        checkpoint's chat format (chat_template_kwargs: K3's `thinking` / `thinking_effort`, or what a
        Jinja template reads); image_url / video_url parts carry base64 data: URLs (see
        k3ray.engine.media.inputs). The text is the model's raw output, channels and all."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; give the LLM one")
        options = options_from_kwargs(chat_template_kwargs, any_kwargs=self.tokenizer.chat_format == JINJA)
        messages = list(messages)
        conversations = [messages] if not messages or isinstance(messages[0], dict) else [list(c) for c in messages]
        inputs = []
        for conversation in conversations:
            ids = self.tokenizer.encode_chat(conversation, add_generation_prompt, continue_final_message, tools, options)
            media = None
            if media_parts(conversation):
                self._media_config()  # a model without a vision tower refuses media by name
                media = read_media(self.engine.multimodal, conversation)
            inputs.append((ids, media))
        return self._run(inputs, sampling_params)

    def _media_config(self) -> MediaConfig:
        if not self.engine.supports_media:
            raise ValueError("this LLM has no vision encoder, so it cannot take images or videos; load a "
                             "checkpoint with a vision tower or pass vision=")
        return self.engine.multimodal.media

    def _prompt_inputs(self, prompt: PromptType) -> tuple[str | Seq[int], list[ProcessedMedia] | None]:
        if not isinstance(prompt, dict):
            return prompt, None
        if "prompt_token_ids" in prompt:
            value = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            value = prompt["prompt"]
        else:
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        data = prompt.get("multi_modal_data")
        return value, None if data is None else media_from_multi_modal_data(data, self._media_config())

    def _run(self, inputs: list[tuple[str | Seq[int], list[ProcessedMedia] | None]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(inputs)
        else:
            params = list(sampling_params)
            if len(params) != len(inputs):
                raise ValueError(f"{len(params)} sampling_params for {len(inputs)} prompts")
        # only the final outputs are kept: the engine builds no other
        requests = [
            self.engine.make_request(f"llm-{next(self._ids)}", prompt, _final_only(sp), media=media)
            for (prompt, media), sp in zip(inputs, params)
        ]
        for request in requests:
            self.engine.enqueue(request)
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(requests):
                for out in self.engine.step():
                    finals[out.request_id] = out
                for _, error in self.engine.take_failed():  # a grammar that could not be compiled
                    raise error
        except BaseException:
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        return [finals[r.request_id] for r in requests]

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


def _checkpoint_dir(model) -> str | os.PathLike:
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be None, a checkpoint directory or a K3ForCausalLM, got {type(model).__name__}")
    return checkpoint_dir(model)


def _load(model, dtype: torch.dtype, device: torch.device, tokenizer=None):
    """(model on device, the tokenizer: given, loaded from a given directory, found beside the model or None)."""
    if isinstance(model, K3ForCausalLM):
        return model.to(device), tokenizer_for(None, tokenizer)
    model = _checkpoint_dir(model)
    return load_model(model, dtype=dtype, device=device), tokenizer_for(model, tokenizer)


def _final_only(params: SamplingParams | None):
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        return params  # make_request names the problem
    return replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
