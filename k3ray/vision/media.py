"""Entry points tying preprocessing to the tower: one media item from its chat part, and packing
several items into one encoder batch."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

import torch

from k3ray.config import MediaConfig
from k3ray.vision.preprocess import PixelBudget, ProcessedMedia, preprocess_image
from k3ray.vision.video import preprocess_video

MEDIA_KINDS = ("image", "video")


def data_url_bytes(url: str, max_bytes: int | None = None) -> bytes:
    """The payload of a base64 `data:` URL (`data:image/png;base64,...`). Remote URLs are refused:
    fetching is the caller's job."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(f"only base64 data: URLs are accepted here, got {str(url)[:40]!r}")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"data URL must be base64-encoded (`data:<mime>;base64,...`), got header {header[:40]!r}")
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes:
        raise ValueError(f"data URL payload exceeds the limit of {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"data URL payload is not valid base64 ({e})") from e


def preprocess_media(kind: str, data: Any, config: MediaConfig, source_fps: float | None = None,
                     budget: PixelBudget | None = None) -> ProcessedMedia:
    """kind "image": bytes or a PIL image; kind "video": animated-image bytes or a list of frames.
    `budget`: the decoded pixels the whole request may still spend (PixelBudget)."""
    if kind == "image":
        return preprocess_image(data, config, budget)
    if kind == "video":
        return preprocess_video(data, config, source_fps, budget)
    raise ValueError(f"unsupported media kind {kind!r}; expected one of {MEDIA_KINDS}")


def pack_media(items: Sequence[ProcessedMedia]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [sum patches, 3, p, p], grid_thws [sum chunks, 3]) for one `encode_media` call;
    the output rows follow the items' order, items[i] taking items[i].num_tokens rows."""
    if not items:
        raise ValueError("pack_media needs at least one media item")
    return torch.cat([m.pixel_values for m in items]), torch.cat([m.grid_thws for m in items])
