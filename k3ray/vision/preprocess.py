"""Images -> NaViT patches for the tower, the way K2.5 / K3 preprocess them (docs/k3-architecture.md §7.3 step 1).

Per image: decode with Pillow (size checked from the header before any pixel is decoded), scale
down (never up, aspect ratio kept) so that floor(w/14) * floor(h/14) fits `max_patches` and no side
exceeds `max_patches_per_side` patches, resize bicubic, flatten transparency onto K3's 8 px
chessboard (255 / 180, white top-left), pad right and bottom with black so both sides are
multiples of 28 (patch 14 x merge 2), normalise (x / 255 - mean) / std, and cut raster-ordered
14 x 14 patches. The padding can add up to one 28-pixel band per side beyond the patch budget,
exactly as the reference does.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from k3ray.config import MediaConfig

CHESS_SQUARE = 8
CHESS_LIGHT, CHESS_DARK = 255, 180
HASH_VERSION = b"k3ray-media-v1"
ImageSource = bytes | bytearray | memoryview | Image.Image


@dataclass(frozen=True, eq=False)  # holds tensors: compare content_hash instead
class ProcessedMedia:
    kind: str  # "image" | "video"
    pixel_values: torch.Tensor  # [sum t*h*w, 3, p, p] float32, chunks in order
    grid_thws: torch.Tensor  # [n_chunks, 3] int64 (t frames, h and w in patches)
    num_tokens: int  # placeholder tokens this item expands to
    content_hash: str  # sha256 of the encoder input: equal hashes -> equal embeddings
    original_size: tuple[int, int]  # (width, height) as supplied
    frame_times: tuple[float, ...] = ()  # seconds, one per sampled video frame


def navit_size(
    width: int, height: int, patch_size: int, merge_size: int, max_patches: int, max_patches_per_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized_w, resized_h), (padded_w, padded_h)) for a width x height input."""
    side_px = max_patches_per_side * patch_size
    patches = max(1, width // patch_size) * max(1, height // patch_size)
    scale = min(1.0, math.sqrt(max_patches / patches), side_px / width, side_px / height)
    new_w = min(max(1, int(width * scale)), side_px)
    new_h = min(max(1, int(height * scale)), side_px)
    unit = patch_size * merge_size
    return (new_w, new_h), (-(-new_w // unit) * unit, -(-new_h // unit) * unit)


class PixelBudget:
    """The decoded pixels one request may still spend (MediaConfig.max_request_pixels), charged
    from each image's or frame's header before its pixels are decoded."""

    def __init__(self, limit: int) -> None:
        self.limit, self.spent = limit, 0

    def charge(self, pixels: int, what: str) -> None:
        if self.spent + pixels > self.limit:
            raise ValueError(f"{what}: its {pixels} pixels would take the request's images and video frames past "
                             f"the limit of {self.limit} decoded pixels ({self.spent} so far)")
        self.spent += pixels


def open_image(data: ImageSource, config: MediaConfig, what: str = "image",
               budget: PixelBudget | None = None) -> Image.Image:
    """A lazily decoded Pillow image whose size has been checked against the limits (and charged
    to `budget`)."""
    if isinstance(data, Image.Image):
        image = data
    elif isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) > config.max_input_bytes:
            raise ValueError(f"{what}: {len(data)} bytes exceeds the limit of {config.max_input_bytes} bytes")
        try:
            image = Image.open(io.BytesIO(bytes(data)))
        except Image.DecompressionBombError as e:
            raise ValueError(f"{what}: too many pixels ({e})") from e
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
            raise ValueError(f"{what}: cannot decode the data as an image ({e})") from e
    else:
        raise ValueError(f"{what}: unsupported media type {type(data).__name__}; expected bytes or a PIL image")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"{what}: empty image of size {width}x{height}")
    if width * height > config.max_input_pixels:
        raise ValueError(
            f"{what}: {width}x{height} = {width * height} pixels exceeds the limit of {config.max_input_pixels}"
        )
    if budget is not None:
        budget.charge(width * height, what)
    return image


def _chessboard(width: int, height: int) -> Image.Image:
    rows, cols = np.indices((height, width)) // CHESS_SQUARE
    board = np.where((rows + cols) % 2 == 0, CHESS_LIGHT, CHESS_DARK).astype(np.uint8)
    return Image.fromarray(np.repeat(board[..., None], 3, axis=-1)).convert("RGBA")


def resized_rgb(image: Image.Image, size: tuple[int, int], what: str = "image") -> np.ndarray:
    """[h, w, 3] uint8: `image` (current frame) resized bicubic to `size` = (w, h), transparency
    composited onto the chessboard after the resize."""
    try:
        has_alpha = "A" in image.getbands() or "transparency" in image.info
        frame = image.convert("RGBA" if has_alpha else "RGB")
        if frame.size != size:
            frame = frame.resize(size, Image.Resampling.BICUBIC)
        if has_alpha:
            frame = Image.alpha_composite(_chessboard(*size), frame).convert("RGB")
        return np.asarray(frame, dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ValueError(f"{what}: cannot decode the image data ({e})") from e


def pad_frame(rgb: np.ndarray, padded: tuple[int, int]) -> np.ndarray:
    """[h, w, 3] uint8 -> [H, W, 3] with black (0) below and to the right; padded = (W, H)."""
    out = np.zeros((padded[1], padded[0], 3), dtype=np.uint8)
    out[: rgb.shape[0], : rgb.shape[1]] = rgb
    return out


def patchify(frames: np.ndarray, config: MediaConfig) -> torch.Tensor:
    """[t, H, W, 3] uint8 -> normalised [t * H/p * W/p, 3, p, p] float32, frame-major then raster."""
    p = config.patch_size
    t, height, width, _ = frames.shape
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float() * (1.0 / 255.0)  # [t, 3, H, W]
    mean = torch.tensor(config.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(config.image_std).view(1, 3, 1, 1)
    x = (x - mean) / std
    x = x.view(t, 3, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)  # [t, gh, gw, 3, p, p]
    return x.reshape(-1, 3, p, p).contiguous()


def frames_to_media(
    kind: str, frames: list[np.ndarray], config: MediaConfig, original_size: tuple[int, int],
    frame_times: tuple[float, ...] = (),
) -> ProcessedMedia:
    """Padded uint8 frames [H, W, 3] (all one size) -> chunks of up to `frames_per_chunk` frames."""
    assert frames and all(f.shape == frames[0].shape for f in frames)
    p, k = config.patch_size, config.frames_per_chunk
    height, width = frames[0].shape[:2]
    digest = hashlib.sha256(HASH_VERSION)
    digest.update(repr((kind, p, config.image_mean, config.image_std)).encode())
    pixels, grids = [], []
    for start in range(0, len(frames), k):
        chunk = np.stack(frames[start : start + k])  # [t, H, W, 3]
        grids.append((chunk.shape[0], height // p, width // p))
        pixels.append(patchify(chunk, config))
        digest.update(repr(grids[-1]).encode())
        digest.update(chunk.tobytes())
    grid_thws = torch.tensor(grids, dtype=torch.long)
    merge = config.merge_size
    num_tokens = len(grids) * (height // p // merge) * (width // p // merge)
    return ProcessedMedia(
        kind, torch.cat(pixels), grid_thws, num_tokens, digest.hexdigest(), original_size, frame_times
    )


def preprocess_image(data: ImageSource, config: MediaConfig, budget: PixelBudget | None = None) -> ProcessedMedia:
    """One image (bytes in any format Pillow reads, or a PIL image; the first frame if animated)."""
    image = open_image(data, config, budget=budget)
    resized, padded = navit_size(
        *image.size, config.patch_size, config.merge_size, config.max_patches, config.max_patches_per_side
    )
    frame = pad_frame(resized_rgb(image, resized), padded)
    return frames_to_media("image", [frame], config, image.size)
