"""`LLM`: vLLM's offline interface over the engine and an in-process model.

    llm = LLM()                                   # the default tiny K3 checkpoint
    llm = LLM("path/to/checkpoint")               # any K3-shaped checkpoint directory
    llm = LLM(build_model(preset("k3-tiny")), tokenizer=ByteTokenizer())
    outs = llm.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as Seq

import torch

from k3ray.engine.config import EngineConfig, SpeculativeConfig
from k3ray.engine.executor import LocalExecutor
from k3ray.engine.llm_engine import LLMEngine
from k3ray.engine.outputs import RequestOutput
from k3ray.engine.stats import EngineStats
from k3ray.models.k3 import K3ForCausalLM
from k3ray.sampling_params import SamplingParams

PromptType = str | Seq[int] | dict


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | K3ForCausalLM | None = None,
        tokenizer=None,
        *,
        draft_model: str | os.PathLike | K3ForCausalLM | None = None,
        speculative: SpeculativeConfig | None = None,
        dtype: torch.dtype = torch.float32,
        **engine_options,
    ) -> None:
        """engine_options are EngineConfig fields (max_num_seqs, block_size, num_blocks, ...)."""
        model, found_tokenizer = _load(model, dtype)
        tokenizer = tokenizer if tokenizer is not None else found_tokenizer
        draft = None if draft_model is None else _load(draft_model, dtype)[0]
        if draft is not None and speculative is None:
            speculative = SpeculativeConfig(method="draft")
        config = EngineConfig(speculative=speculative, **engine_options)
        self.engine = LLMEngine(LocalExecutor(model, draft), config, tokenizer)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        requests = [
            self.engine.make_request(f"llm-{next(self._ids)}", _prompt_value(p), sp) for p, sp in zip(prompts, params)
        ]
        for request in requests:
            self.engine.enqueue(request)
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(requests):
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        return [finals[r.request_id] for r in requests]

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


def _load(model, dtype: torch.dtype):
    """(model, tokenizer found beside it or None)."""
    if isinstance(model, K3ForCausalLM):
        return model, None
    from k3ray.tokenizer import load_tokenizer
    from k3ray.weights import load_model

    if model is None:
        from k3ray.default_model import default_checkpoint_dir

        model = default_checkpoint_dir()
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be None, a checkpoint directory or a K3ForCausalLM, got {type(model).__name__}")
    loaded = load_model(model, dtype=dtype)
    try:
        tokenizer = load_tokenizer(model)
    except ValueError:
        tokenizer = None
    return loaded, tokenizer


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _prompt_value(prompt: PromptType):
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"]
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    return prompt
