"""Videos -> frame chunks for the tower, without ffmpeg: animated images Pillow reads (GIF, APNG,
animated WebP, multi-page TIFF) or a list of frames.

Frames are sampled at `video_fps` (never faster than the source: a frame is never taken twice) and,
when that would exceed `video_max_frames`, spread evenly over the whole clip. Every frame is resized
to the first frame's NaViT size under the per-frame budget `video_max_patches_per_frame`, then the
frames are grouped into chunks of `frames_per_chunk` (the last chunk may be shorter). A GIF frame
without a duration counts as 100 ms, as browsers show it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from PIL import Image

from k3ray.config import MediaConfig
from k3ray.vision.preprocess import (
    ImageSource,
    PixelBudget,
    ProcessedMedia,
    frames_to_media,
    navit_size,
    open_image,
    pad_frame,
    resized_rgb,
)

DEFAULT_FRAME_SECONDS = 0.1


def sample_times(duration: float, fps: float, max_frames: int) -> list[float]:
    """Sampling instants in [0, duration): every 1/fps seconds, or max_frames evenly spread."""
    step = max(1.0 / fps, duration / max_frames)
    count = max(1, min(max_frames, int(duration / step + 1e-9)))  # 1e-9: 0.3 / 0.1 is 2.999...
    return [k * step for k in range(count)]


def sample_frame_indices(frame_starts: Sequence[float], duration: float, fps: float, max_frames: int) -> list[int]:
    """Indices of the frames on screen at each sampling instant, deduplicated, ascending."""
    picked = {max(0, bisect.bisect_right(frame_starts, t) - 1) for t in sample_times(duration, fps, max_frames)}
    return sorted(picked)


def _file_frames(data: bytes | bytearray | memoryview, config: MediaConfig,
                 budget: PixelBudget | None = None) -> tuple[Image.Image, list[float], float]:
    """The opened animation, each frame's start time, and the total duration (seconds)."""
    image = open_image(data, config, what="video")
    count = getattr(image, "n_frames", 1)
    if budget is not None:  # every frame is decoded to find its timing
        width, height = image.size
        budget.charge(count * width * height, f"video: {count} frames of {width}x{height}")
    if count > config.max_source_frames:
        raise ValueError(f"video: {count} frames exceeds the limit of {config.max_source_frames}")
    decoded = count * image.size[0] * image.size[1]
    if decoded > config.max_video_source_pixels:
        raise ValueError(
            f"video: {count} frames of {image.size[0]}x{image.size[1]} = {decoded} pixels to decode exceeds "
            f"the limit of {config.max_video_source_pixels}"
        )
    starts, clock = [], 0.0
    try:
        for index in range(count):
            image.seek(index)
            starts.append(clock)
            duration_ms = image.info.get("duration") or 0
            clock += duration_ms / 1000.0 if duration_ms > 0 else DEFAULT_FRAME_SECONDS
    except (OSError, EOFError, SyntaxError, ValueError) as e:
        raise ValueError(f"video: cannot decode frame {len(starts)} ({e})") from e
    return image, starts, clock


def preprocess_video(
    data: bytes | bytearray | memoryview | Sequence[ImageSource], config: MediaConfig, source_fps: float | None = None,
    budget: PixelBudget | None = None,
) -> ProcessedMedia:
    """One video: animated-image bytes, or a list of frames (bytes or PIL images). A list is taken as
    already sampled unless `source_fps` gives its frame rate. One frame is decoded at a time (and
    charged to `budget` before it is), so memory holds one full-size frame, not all of them."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        animation, starts, duration = _file_frames(data, config, budget)
        indices = sample_frame_indices(starts, duration, config.video_fps, config.video_max_frames)

        def frame(k: int) -> Image.Image:
            try:
                animation.seek(indices[k])
                return animation.copy()
            except (OSError, EOFError, SyntaxError, ValueError) as e:
                raise ValueError(f"video: cannot decode frame {indices[k]} ({e})") from e
    elif isinstance(data, Sequence) and not isinstance(data, str):
        if not data:
            raise ValueError("video: the frame list is empty")
        if len(data) > config.max_source_frames:
            raise ValueError(f"video: {len(data)} frames exceeds the limit of {config.max_source_frames}")
        if source_fps is not None and not source_fps > 0:
            raise ValueError(f"video: source_fps must be positive, got {source_fps!r}")
        fps = source_fps or config.video_fps
        starts = [i / fps for i in range(len(data))]
        indices = sample_frame_indices(starts, len(data) / fps, config.video_fps, config.video_max_frames)

        def frame(k: int) -> Image.Image:
            return open_image(data[indices[k]], config, what=f"video frame {indices[k]}", budget=budget)
    else:
        raise ValueError(f"video: unsupported media type {type(data).__name__}; expected bytes or a list of frames")
    times = tuple(starts[i] for i in indices)

    first = frame(0)
    first_size = first.size
    resized, padded = navit_size(
        *first_size, config.patch_size, config.merge_size, config.video_max_patches_per_frame,
        config.max_patches_per_side,
    )
    rgb = [pad_frame(resized_rgb(first, resized, "video frame"), padded)]
    del first  # its decoded pixels go before the next frame's are decoded
    for k in range(1, len(indices)):
        rgb.append(pad_frame(resized_rgb(frame(k), resized, "video frame"), padded))
    return frames_to_media("video", rgb, config, first_size, times)
