"""Training items for the vision-language fixture, built exactly as a request reaches the engine:
the eval's chat messages (evals.tasks.multimodal), the tokenizer's chat template, the server's
media decoding and preprocessing (engine.media_inputs) and placeholder expansion.

Kinds: "image@N" (N images, one with the card), "frames@N" / "gif@N" (an N-frame video, the card on
one frame, sent as image parts or as one animated GIF) and any text item kind of `data` ("niah@ruler+chat"),
so the model stays a needle reader.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from k3ray.engine.media_inputs import media_from_messages
from k3ray.evals.tasks import images, multimodal
from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer import special as sp
from k3ray.vision import MediaConfig, ProcessedMedia
from k3ray.vision.placeholders import expand_placeholders
from k3ray_training import cards, data
from k3ray_training.data import Example

MEDIA_KINDS = ("image", "frames", "gif")
TEXT_HAYSTACKS = (300, 700, 1200)  # characters of haystack in the text items


@dataclass(frozen=True, eq=False)  # holds tensors
class VisionExample:
    example: Example  # prompt: the expanded ids (one placeholder id per media token)
    media: tuple[ProcessedMedia, ...]
    media_positions: torch.Tensor  # [M] prompt positions of the media tokens, items in order
    digit_positions: tuple[int, ...]  # prompt positions meant to carry the card's digits, in order
    digit_ids: tuple[int, ...]  # those digits' token ids


def parse_kind(spec: str) -> tuple[str, int]:
    """ "image@4" -> ("image", 4); a text kind -> (spec, 0). ValueError for a kind that cannot be built."""
    kind, _, count = spec.partition("@")
    if kind not in MEDIA_KINDS:
        data.ItemKind.parse(spec)
        return spec, 0
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"{spec!r}: a media kind needs a positive count, as image@4")
    return kind, int(count)


def _chat(messages: list[dict], code: str, tokenizer: ByteTokenizer, media_config: MediaConfig,
          placeholder: int) -> tuple[Example, tuple[ProcessedMedia, ...], tuple[tuple[int, int], ...]]:
    ids = tokenizer.encode_chat(messages)
    media = tuple(media_from_messages(messages, media_config))
    expanded = expand_placeholders(ids, placeholder, [m.num_tokens for m in media])
    answer = tokenizer.encode(code) + [tokenizer.special_tokens[sp.IM_END]]
    return Example("", expanded.token_ids, answer, (code,)), media, expanded.spans


def media_example(kind: str, count: int, rng: random.Random, tokenizer: ByteTokenizer, media_config: MediaConfig,
                  placeholder: int, faces: tuple[str, ...], varied_share: float) -> VisionExample:
    """A card among `count` images or frames: the eval's card, or with probability `varied_share` a varied one."""
    index = rng.randrange(count)
    if kind == "image":
        pictures = [images.scene(rng) for _ in range(count)]
    else:
        pictures = images.moving_frames(rng, count)
    card = cards.training_card(pictures[index], rng, faces, varied_share)
    pictures[index] = card.image
    if kind == "image":
        messages = multimodal.image_messages(pictures)
    else:
        messages = multimodal.video_messages(pictures, "gif" if kind == "gif" else "frames")
    example, media, spans = _chat(messages, card.code, tokenizer, media_config, placeholder)
    if kind == "gif":  # one media item; frames are pooled in chunks, each chunk one grid of tokens
        per_chunk = cards.GRID_SIDE**2
        start = spans[0][0] + (index // media_config.frames_per_chunk) * per_chunk
    else:
        start = spans[index][0]
    digit_positions = tuple(start + t for t in card.tokens)
    positions = torch.cat([torch.arange(s, s + n) for s, n in spans])
    return VisionExample(Example(f"{kind}@{count}", example.prompt, example.answer, example.references), media,
                         positions, digit_positions, tuple(tokenizer.encode(card.code)))


def text_example(kind: str, rng: random.Random, tokenizer: ByteTokenizer) -> VisionExample:
    example = data.make_example(kind, rng.choice(TEXT_HAYSTACKS), rng, tokenizer)
    return VisionExample(example, (), torch.empty(0, dtype=torch.long), (), ())


def make_item(spec: str, rng: random.Random, tokenizer: ByteTokenizer, media_config: MediaConfig,
              placeholder: int, faces: tuple[str, ...], varied_share: float = 0.0) -> VisionExample:
    kind, count = parse_kind(spec)
    if count:
        return media_example(kind, count, rng, tokenizer, media_config, placeholder, faces, varied_share)
    return text_example(kind, rng, tokenizer)
