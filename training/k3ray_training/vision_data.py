"""Training items for the vision-language fixture, built exactly as a request reaches the engine:
the eval's chat messages (evals.tasks.multimodal), the tokenizer's chat template, the server's
media decoding and preprocessing (engine.media_inputs) and placeholder expansion.

Kinds: "image@N" (N images, one with the card), "frames@N" / "gif@N" (an N-frame video, the card on
one frame, sent as image parts or as one animated GIF), "order@N" / "gif_order@N" (the eval's
video_order: two cards in an N-frame video, the first one's code asked for) and any text item kind of
`data` ("niah@ruler+chat"), so the model stays a needle reader.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from k3ray.engine.media.inputs import media_from_messages
from k3ray.evals.tasks import images, multimodal
from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer import special as sp
from k3ray.vision import MediaConfig, ProcessedMedia
from k3ray.vision.placeholders import expand_placeholders
from k3ray_training import cards, data
from k3ray_training.data import Example

MEDIA_KINDS = ("image", "frames", "gif", "order", "gif_order")
GIF_KINDS = ("gif", "gif_order")
ORDER_KINDS = ("order", "gif_order")  # two cards, the first asked for
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
    if kind in ORDER_KINDS and int(count) <= multimodal.ORDER_CHUNK:
        raise ValueError(f"{spec!r}: two cards need more than {multimodal.ORDER_CHUNK} frames")
    return kind, int(count)


def _chat(messages: list[dict], code: str, tokenizer: ByteTokenizer, media_config: MediaConfig,
          placeholder: int) -> tuple[Example, tuple[ProcessedMedia, ...], tuple[tuple[int, int], ...]]:
    ids = tokenizer.encode_chat(messages)
    media = tuple(media_from_messages(messages, media_config))
    expanded = expand_placeholders(ids, placeholder, [m.num_tokens for m in media])
    answer = tokenizer.encode(code) + [tokenizer.special_tokens[sp.IM_END]]
    return Example("", expanded.token_ids, answer, (code,)), media, expanded.spans


def _digit_start(kind: str, index: int, spans, media_config: MediaConfig) -> int:
    """The prompt position of the first merged token of picture `index`'s grid."""
    if kind in GIF_KINDS:  # one media item; frames are pooled in chunks, each chunk one grid of tokens
        return spans[0][0] + (index // media_config.frames_per_chunk) * cards.GRID_SIDE**2
    return spans[index][0]


def media_chat(kind: str, count: int, rng: random.Random, faces: tuple[str, ...],
               varied_share: float) -> tuple[list[dict], tuple[int, ...], tuple[cards.Card, ...]]:
    """(the eval's chat messages, the pictures holding cards, their cards) of a media kind: a card among
    `count` images or frames, two for the order kinds (the first asked for); each the eval's card, or
    with probability `varied_share` a varied one."""
    two = kind in ORDER_KINDS
    indices = multimodal.order_indices(rng, count) if two else (rng.randrange(count),)
    if kind == "image":
        pictures = [images.scene(rng) for _ in range(count)]
    else:
        pictures = images.moving_frames(rng, count)
    codes = multimodal.two_codes(rng) if two else (None,)
    placed = []
    for index, code in zip(indices, codes):
        placed.append(cards.training_card(pictures[index], rng, faces, varied_share, code))
        pictures[index] = placed[-1].image
    if kind == "image":
        return multimodal.image_messages(pictures), indices, tuple(placed)
    video_format = "gif" if kind in GIF_KINDS else "frames"
    return multimodal.video_messages(pictures, video_format, len(placed)), indices, tuple(placed)


def media_example(kind: str, count: int, rng: random.Random, tokenizer: ByteTokenizer, media_config: MediaConfig,
                  placeholder: int, faces: tuple[str, ...], varied_share: float) -> VisionExample:
    """media_chat's item as the engine builds it, naming the tokens meant to carry every card's digits."""
    messages, indices, placed = media_chat(kind, count, rng, faces, varied_share)
    example, media, spans = _chat(messages, placed[0].code, tokenizer, media_config, placeholder)
    digit_positions = tuple(_digit_start(kind, index, spans, media_config) + t
                            for index, card in zip(indices, placed) for t in card.tokens)
    positions = torch.cat([torch.arange(s, s + n) for s, n in spans])
    digit_ids = tuple(i for card in placed for i in tokenizer.encode(card.code))
    return VisionExample(Example(f"{kind}@{count}", example.prompt, example.answer, example.references), media,
                         positions, digit_positions, digit_ids)


def text_example(kind: str, rng: random.Random, tokenizer: ByteTokenizer) -> VisionExample:
    example = data.make_example(kind, rng.choice(TEXT_HAYSTACKS), rng, tokenizer)
    return VisionExample(example, (), torch.empty(0, dtype=torch.long), (), ())


def make_item(spec: str, rng: random.Random, tokenizer: ByteTokenizer, media_config: MediaConfig,
              placeholder: int, faces: tuple[str, ...], varied_share: float = 0.0) -> VisionExample:
    kind, count = parse_kind(spec)
    if count:
        return media_example(kind, count, rng, tokenizer, media_config, placeholder, faces, varied_share)
    return text_example(kind, rng, tokenizer)
