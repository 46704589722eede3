"""User-facing media -> ProcessedMedia: OpenAI chat parts and vLLM-style `multi_modal_data`, plus
an engine's media reading (its settings: k3ray.engine.config.MultiModalConfig).

Chat parts, in placeholder order (the order `render_chat` emits them):
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    {"type": "video_url", "video_url": {"url": "data:image/gif;base64,..."}}      animated GIF / APNG / WebP
    {"type": "video_url", "video_url": {"url": ["data:image/png;base64,...", ...]}}   the frames of a video
A plain string in place of the {"url": ...} object is accepted too. http(s) URLs need a `fetch`
callable (the server's, when remote URLs are enabled); nothing here touches the network. file://
URLs are read only under an allowed local folder (vLLM's `--allowed-local-media-path`), off by default.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

from k3ray.config import VisionConfig
from k3ray.engine.config import MultiModalConfig
from k3ray.vision import MediaConfig, ProcessedMedia, data_url_bytes, preprocess_media
from k3ray.vision.preprocess import PixelBudget

PREPROCESSOR_CONFIG = "preprocessor_config.json"
MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video"}
Fetch = Callable[[str], bytes]


class MediaInputError(ValueError):
    """Bad media in a request; `param` names the offending part (e.g. "messages[0].content[1]")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def read_media(multimodal: MultiModalConfig, messages: Sequence[dict],
               fetch: Fetch | None = None) -> list[ProcessedMedia]:
    """Every image / video of a conversation under an engine's media settings (see media_from_messages);
    `fetch`: the server's, when it may fetch http(s) URLs."""
    assert multimodal.media is not None, "no media settings: an engine without a vision tower takes no media"
    return media_from_messages(messages, multimodal.media, fetch=fetch, max_items=multimodal.max_items_per_prompt,
                               local_root=multimodal.allowed_local_media_path)


def load_media_config(checkpoint: str | os.PathLike, vision: VisionConfig, **overrides: Any) -> MediaConfig:
    """The checkpoint's `preprocessor_config.json` if it has one (checked against the tower), else
    the tower's defaults."""
    path = os.path.join(os.fspath(checkpoint), PREPROCESSOR_CONFIG)
    if not os.path.isfile(path):
        return MediaConfig.for_vision(vision, **overrides)
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    config = MediaConfig.from_preprocessor_config(data, **overrides)
    tower = MediaConfig.for_vision(vision)
    for name in ("patch_size", "merge_size", "frames_per_chunk"):
        if getattr(config, name) != getattr(tower, name):
            raise ValueError(f"{path}: {name}={getattr(config, name)} does not match the vision tower's "
                             f"{getattr(tower, name)}")
    return config


@dataclass(frozen=True)
class MediaPart:
    where: str  # "messages[i].content[j]"
    part_type: str  # "image_url" | "video_url"
    value: Any  # the part's image_url / video_url field

    @property
    def kind(self) -> str:
        return MEDIA_PART_TYPES[self.part_type]


def media_parts(messages: Sequence[dict]) -> list[MediaPart]:
    """The image / video parts of a conversation, in the order their placeholders appear."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type in MEDIA_PART_TYPES:
                out.append(MediaPart(f"messages[{i}].content[{j}]", part_type, part.get(part_type)))
    return out


def _local_bytes(url: str, part: MediaPart, config: MediaConfig, local_root: str | None) -> bytes:
    """A file:// URL's bytes, if the file lies under `local_root` (symlinks resolved)."""
    if local_root is None:
        raise MediaInputError(f"local {part.part_type} files (file:// URLs) are not allowed here: send the media "
                              "inline as a base64 data: URL, or allow a folder (--allowed-local-media-path)", part.where)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaInputError(f"{part.part_type} {url[:80]!r}: a file:// URL names no host", part.where)
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(local_root)
    if os.path.commonpath([path, root]) != root:
        raise MediaInputError(f"{part.part_type} {url[:80]!r} lies outside the allowed local media folder",
                              part.where)
    try:
        if os.path.getsize(path) > config.max_input_bytes:
            raise MediaInputError(f"{part.part_type} {url[:80]!r} exceeds the limit of {config.max_input_bytes} bytes",
                                  part.where)
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise MediaInputError(f"{part.part_type} {url[:80]!r} could not be read: {e.strerror}", part.where) from e


def _url_bytes(url: Any, part: MediaPart, config: MediaConfig, fetch: Fetch | None,
               local_root: str | None = None) -> bytes:
    if not isinstance(url, str):
        raise MediaInputError(f"{part.part_type} URL is not supported: expected a string, got {type(url).__name__}",
                              part.where)
    if url.startswith("file:"):
        return _local_bytes(url, part, config, local_root)
    if url.startswith(("http://", "https://")):
        if fetch is None:
            raise MediaInputError(
                f"remote {part.part_type} URLs are not supported by this server: send the media inline as a "
                "base64 data: URL (data:<mime>;base64,...)", part.where)
        try:
            data = fetch(url)
        except ValueError as e:
            raise MediaInputError(f"{part.part_type} {url[:80]!r} could not be fetched: {e}", part.where) from e
        if len(data) > config.max_input_bytes:
            raise MediaInputError(f"{part.part_type} {url[:80]!r}: {len(data)} bytes exceeds the limit of "
                                  f"{config.max_input_bytes} bytes", part.where)
        return data
    try:
        return data_url_bytes(url, config.max_input_bytes)
    except ValueError as e:
        raise MediaInputError(f"{part.part_type} URL is not supported: {e}", part.where) from e


def _part_media(part: MediaPart, config: MediaConfig, fetch: Fetch | None, budget: PixelBudget,
                local_root: str | None) -> ProcessedMedia:
    value = part.value
    url = value.get("url") if isinstance(value, dict) else value
    if url is None:
        raise MediaInputError(f"{part.part_type} part needs a 'url'", part.where)
    if isinstance(url, list):
        if part.kind != "video":
            raise MediaInputError(f"{part.part_type} 'url' must be one URL, got a list", part.where)
        if not url:
            raise MediaInputError("video_url frame list is empty", part.where)
        data: bytes | list[bytes] = [_url_bytes(u, part, config, fetch, local_root) for u in url]
    else:
        data = _url_bytes(url, part, config, fetch, local_root)
    try:
        return preprocess_media(part.kind, data, config, budget=budget)
    except ValueError as e:
        raise MediaInputError(f"{part.part_type} could not be read: {e}", part.where) from e


def media_from_messages(messages: Sequence[dict], config: MediaConfig, *, fetch: Fetch | None = None,
                        max_items: int | None = None, local_root: str | None = None) -> list[ProcessedMedia]:
    """Decode and preprocess every image / video part of a conversation, in placeholder order, at
    most config.max_request_pixels decoded pixels in all; file:// URLs are read under `local_root` only."""
    parts = media_parts(messages)
    if max_items is not None and len(parts) > max_items:
        raise MediaInputError(f"the conversation holds {len(parts)} images / videos; at most {max_items} "
                              "are allowed per request", "messages")
    budget = PixelBudget(config.max_request_pixels)
    return [_part_media(part, config, fetch, budget, local_root) for part in parts]


def media_from_multi_modal_data(data: dict, config: MediaConfig) -> list[ProcessedMedia]:
    """vLLM's `multi_modal_data`: {"image": image | [image, ...]} or {"video": video | [video, ...]};
    an image is bytes or a PIL image, a video is animated-image bytes or a list of frames. Both kinds
    in one prompt are refused (their order would be ambiguous: use chat messages)."""
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict, got {type(data).__name__}")
    unknown = sorted(set(data) - {"image", "video"})
    if unknown:
        raise ValueError(f"multi_modal_data supports 'image' and 'video', got {unknown}")
    given = {kind: value for kind, value in data.items() if value is not None}
    if len(given) > 1:
        raise ValueError("multi_modal_data with both images and videos is ambiguous about their order; "
                         "pass chat messages instead (LLM.chat)")
    out = []
    for kind, value in given.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for i, item in enumerate(values):
            try:
                out.append(preprocess_media(kind, item, config))
            except ValueError as e:
                raise ValueError(f"multi_modal_data[{kind!r}][{i}]: {e}") from e
    return out
