"""Multimodal needles: a code card among N images, or on one frame of an N-frame video; and, so
that frame order counts, two cards in one video of which the first is asked for (`video_order`).

The cell's length is the number of images (frames) and its depth places the needle (the first card)
among them.
Prompts are OpenAI chat messages; images travel as PNG data: URLs in `image_url` parts. A video
travels either as its frames (`image_url` parts, as lmms-eval sends video to OpenAI-style servers)
or as one `video_url` part holding a lossless animated GIF.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3ray.evals.target import Prompt, Target, count_chat_tokens
from k3ray.evals.tasks import images
from k3ray.evals.tasks.base import Cell, Item, Task, cell_rng, pick_depth

VIDEO_FORMATS = ("frames", "gif")
QUESTION = "What is the code on the white card? Answer with the digits only."
ORDER_QUESTION = "What is the code on the first of the two cards? Answer with the digits only."
# K3 pools each 4 frames of a video into one grid of tokens (MediaConfig.frames_per_chunk): the two
# cards of `video_order` sit in different 4-frame chunks, so each stays readable
ORDER_CHUNK = 4


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(img) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": images.png_data_url(img)}}


def _code_and_index(rng, cell: Cell) -> tuple[str, int, float]:
    if cell.length < 1:
        raise ValueError(f"a multimodal needle needs at least one image, got length {cell.length}")
    depth = pick_depth(rng, cell)
    code = random_code(rng)
    return code, round(depth / 100 * (cell.length - 1)), depth


@dataclass(frozen=True)
class ImageNeedle(Task):
    name: str = "image_niah"
    max_tokens: int = 16
    unit = "images"

    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False,
              chat: bool = False) -> Item:
        rng = cell_rng(seed, cell)
        code, index, depth = _code_and_index(rng, cell)
        pictures = [images.scene(rng) for _ in range(cell.length)]
        pictures[index] = images.with_card(pictures[index], code)
        return _chat_item(target, image_messages(pictures), code, self.max_tokens, depth)


def image_messages(pictures: list) -> list[dict[str, Any]]:
    """The chat an image needle sends: an intro, every picture as a PNG `image_url`, the question."""
    intro = f"Here are {len(pictures)} images. One of them shows a white card with a code of digits."
    return [{"role": "user", "content": [_text(intro), *(_image(p) for p in pictures), _text(QUESTION)]}]


def video_messages(frames: list, video_format: str, cards: int = 1) -> list[dict[str, Any]]:
    """The chat a video needle sends: the frames as `image_url` parts ("frames") or one GIF `video_url`;
    with `cards=2`, video_order's chat (two cards, the first asked for)."""
    if video_format not in VIDEO_FORMATS:
        raise ValueError(f"video_format must be one of {VIDEO_FORMATS}, got {video_format!r}")
    if cards not in (1, 2):
        raise ValueError(f"a video needle shows one or two cards, got {cards!r}")
    intro = f"Here is a video of {len(frames)} frames. " + (
        "One frame shows a white card with a code of digits." if cards == 1
        else "Two frames, one after the other, show a white card with a code of digits.")
    question = QUESTION if cards == 1 else ORDER_QUESTION
    if video_format == "gif":
        media = [{"type": "video_url", "video_url": {"url": images.gif_data_url(frames)}}]
    else:
        media = [_image(f) for f in frames]
    return [{"role": "user", "content": [_text(intro), *media, _text(question)]}]


def _chat_item(target: Target, messages: list[dict[str, Any]], code: str, max_tokens: int, depth: float) -> Item:
    return Item(messages, (code,), "all", max_tokens, count_chat_tokens(target, messages), depth)


@dataclass(frozen=True)
class VideoNeedle(Task):
    name: str = "video_niah"
    video_format: str = "frames"
    max_tokens: int = 16
    unit = "frames"

    def __post_init__(self) -> None:
        if self.video_format not in VIDEO_FORMATS:
            raise ValueError(f"video_format must be one of {VIDEO_FORMATS}, got {self.video_format!r}")

    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False,
              chat: bool = False) -> Item:
        rng = cell_rng(seed, cell)
        code, index, depth = _code_and_index(rng, cell)
        frames = images.moving_frames(rng, cell.length)
        frames[index] = images.with_card(frames[index], code)
        return _chat_item(target, video_messages(frames, self.video_format), code, self.max_tokens, depth)


def order_indices(rng, count: int, depth: float | None = None) -> tuple[int, int]:
    """(first, second) frames of video_order's cards, in different ORDER_CHUNK-frame chunks; `depth`
    (percent) places the first among the frames that have a later chunk, None draws it."""
    if count <= ORDER_CHUNK:
        raise ValueError(f"video_order needs more than {ORDER_CHUNK} frames (two chunks), got {count}")
    last_chunk = (count - 1) // ORDER_CHUNK * ORDER_CHUNK  # the first frame of the last chunk
    first = rng.randrange(last_chunk) if depth is None else round(depth / 100 * (last_chunk - 1))
    return first, rng.randrange((first // ORDER_CHUNK + 1) * ORDER_CHUNK, count)


def random_code(rng) -> str:
    return "".join(rng.choice("0123456789") for _ in range(images.CODE_LENGTH))


def two_codes(rng) -> tuple[str, str]:
    first = random_code(rng)
    while (second := random_code(rng)) == first:
        pass
    return first, second


@dataclass(frozen=True)
class VideoOrder(VideoNeedle):
    """Two cards in one video, in different chunks of frames; the code on the first is the answer,
    so frames out of order (two swapped) read the other card's."""

    name: str = "video_order"
    min_length = ORDER_CHUNK + 1

    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False,
              chat: bool = False) -> Item:
        rng = cell_rng(seed, cell)
        depth = pick_depth(rng, cell)
        first, second = order_indices(rng, cell.length, depth)
        codes = two_codes(rng)
        frames = images.moving_frames(rng, cell.length)
        frames[first] = images.with_card(frames[first], codes[0])
        frames[second] = images.with_card(frames[second], codes[1])
        messages = video_messages(frames, self.video_format, cards=2)
        return _chat_item(target, messages, codes[0], self.max_tokens, depth)


def read(prompt: Prompt) -> str | None:
    """Look at every image and frame in chat messages and read the first card found (video_order's answer too)."""
    if isinstance(prompt, str):
        return None
    for message in prompt:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type")
            if kind not in ("image_url", "video_url"):
                continue
            for frame in images.decode_data_url(part[kind]["url"]):
                code = images.read_code(frame)
                if code is not None:
                    return code
    return None


TASKS = (ImageNeedle(), VideoNeedle(), VideoNeedle("video_niah_gif", video_format="gif"), VideoOrder(),
         VideoOrder("video_order_gif", video_format="gif"))
