"""A request's input, checked before the engine takes it: the prompt as token ids (text encoded), its media
expanded to placeholder spans, its length and its sampling parameters checked against this engine."""

from __future__ import annotations

import operator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from k3ray.config import ModelConfig
from k3ray.engine.config import MultiModalConfig
from k3ray.engine.media.prompt_media import PromptMedia, VisionEncoderFn, attach_media
from k3ray.sampling_params import SamplingParams
from k3ray.vision import ProcessedMedia


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str | None  # the prompt as given, when it was text
    token_ids: list[int]  # media placeholders expanded
    media: PromptMedia | None


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer, max_model_len: int, max_schema_bytes: int,
                 vision_encoder: VisionEncoderFn | None, multimodal: MultiModalConfig) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.max_schema_bytes = max_schema_bytes
        self.vision_encoder = vision_encoder
        self.multimodal = multimodal

    def process(self, prompt: str | Seq[int], params: SamplingParams,
                media: Seq[ProcessedMedia] | None = None) -> ProcessedPrompt:
        """Raises ValueError naming what this engine cannot take."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt, allow_special=bool(media))
        prompt_media = None
        if media:
            ids, prompt_media = self._attach_media(ids, media)
        if len(ids) > self.max_model_len:  # a full-length prompt still yields one token (as in vLLM)
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        params.validate(self.vocab_size, self.max_model_len, self.max_schema_bytes)
        return ProcessedPrompt(text, ids, prompt_media)

    def tokenize(self, prompt: str | Seq[int], allow_special: bool = False) -> tuple[str | None, list[int]]:
        """A text prompt encoded (special-token strings kept as text unless allow_special), or token ids
        checked -> (the text or None, the ids)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            ids = self.tokenizer.encode(prompt, allow_special=allow_special)
            text = prompt
        else:
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError("a prompt must be a str or a sequence of int token ids") from None
            text = None
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return text, ids

    def _attach_media(self, ids: list[int], media: Seq[ProcessedMedia]) -> tuple[list[int], PromptMedia]:
        if self.vision_encoder is None:
            raise ValueError("this engine has no vision encoder (the checkpoint has no vision tower, or none was "
                             "given), so it cannot take images or videos")
        if len(media) > self.multimodal.max_items_per_prompt:
            raise ValueError(f"the prompt has {len(media)} media items; at most "
                             f"{self.multimodal.max_items_per_prompt} are allowed")
        return attach_media(ids, self.model_config.media_placeholder_token_id, list(media), self.model_config.vision)
