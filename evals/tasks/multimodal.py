"""Multimodal needles: a code card among N images, or on one frame of an N-frame video.

The cell's length is the number of images (frames) and its depth places the needle among them.
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


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(img) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": images.png_data_url(img)}}


def _code_and_index(rng, cell: Cell) -> tuple[str, int, float]:
    if cell.length < 1:
        raise ValueError(f"a multimodal needle needs at least one image, got length {cell.length}")
    depth = pick_depth(rng, cell)
    code = "".join(rng.choice("0123456789") for _ in range(images.CODE_LENGTH))
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


def video_messages(frames: list, video_format: str) -> list[dict[str, Any]]:
    """The chat a video needle sends: the frames as `image_url` parts ("frames") or one GIF `video_url`."""
    if video_format not in VIDEO_FORMATS:
        raise ValueError(f"video_format must be one of {VIDEO_FORMATS}, got {video_format!r}")
    intro = f"Here is a video of {len(frames)} frames. One frame shows a white card with a code of digits."
    if video_format == "gif":
        media = [{"type": "video_url", "video_url": {"url": images.gif_data_url(frames)}}]
    else:
        media = [_image(f) for f in frames]
    return [{"role": "user", "content": [_text(intro), *media, _text(QUESTION)]}]


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


def read(prompt: Prompt) -> str | None:
    """Look at every image and frame in chat messages and read the first card found."""
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


TASKS = (ImageNeedle(), VideoNeedle(), VideoNeedle("video_niah_gif", video_format="gif"))
