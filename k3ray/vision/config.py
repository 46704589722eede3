"""Constants of the MoonViT3d tower and the media preprocessing settings (`MediaConfig`).

Tower norm eps: every RMSNorm inside the tower (norm0, norm1, final_layernorm) uses 2^-7. The SGLang
port of the checkpoint's `modeling_kimi_k3.py` builds `nn.RMSNorm(dim)` with no eps, which means
`torch.finfo(dtype).eps`: 2^-7 for the published bf16 weights. A second port (mlxcel) pins 2^-7 and says
the reference writes `2 ** -7`. Both agree for bf16, so the constant is used for every dtype (a float32
run then matches the bf16 reference's normalisation rather than finfo(float32)). The projector's
post_norm uses the config's `projector_ln_eps` (1e-5). See docs/k3-architecture.md §7.3, §12.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from k3ray.config import VisionConfig

VISION_NORM_EPS = 2.0**-7
ROPE_THETA = 10000.0
ROPE_MAX_GRID = 512  # Rope2DPosEmbRepeated's table: 512 x 512 patches
TEMPORAL_THETA = 10000.0


@dataclass(frozen=True)
class MediaConfig:
    """How images and videos become patches (K2.5 / K3 `media_proc_cfg`; defaults are K2.5's as
    published in transformers 5.18.0 `Kimi_K25ImageProcessor` / `Kimi_K25VideoProcessor`).

    Normalisation (x / 255 - 0.5) / 0.5 per channel: K2.5's processors use IMAGENET_STANDARD_MEAN /
    STD = [0.5] * 3, and K3's `preprocessor_config.json` carries `image_mean` / `image_std` in
    `media_proc_cfg` (read by `from_preprocessor_config`)."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384  # in_patch_limit: raw 14x14 patches per image before padding
    max_patches_per_side: int = 512  # patch_limit_on_one_side
    video_max_patches_per_frame: int = 4096  # in_patch_limit_each_frame
    frames_per_chunk: int = 4  # temporal_merge_kernel_size
    video_fps: float = 2.0  # sample_fps
    video_max_frames: int = 64  # frames kept per video after sampling
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_input_pixels: int = 89_478_485  # per decoded image or frame (Pillow's decompression-bomb threshold)
    max_input_bytes: int = 64 * 2**20
    max_source_frames: int = 10_000  # frames in a video file (each is decoded to find its timing)
    max_video_source_pixels: int = 1_000_000_000  # frames x width x height of a video file, all decoded
    max_request_pixels: int = 2**28  # decoded pixels of one request, summed over its images and frames

    def __post_init__(self) -> None:
        for f in fields(self):
            val = getattr(self, f.name)
            if f.name in ("image_mean", "image_std"):
                if len(val) != 3 or not all(isinstance(x, (int, float)) for x in val):
                    raise ValueError(f"MediaConfig.{f.name} must be 3 numbers, got {val!r}")
                if f.name == "image_std" and min(val) <= 0:
                    raise ValueError(f"MediaConfig.image_std must be positive, got {val!r}")
            elif f.name == "video_fps":
                if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                    raise ValueError(f"MediaConfig.video_fps must be a positive number, got {val!r}")
            elif not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"MediaConfig.{f.name} must be a positive int, got {val!r}")
        if self.max_patches_per_side > ROPE_MAX_GRID:
            raise ValueError(
                f"MediaConfig.max_patches_per_side={self.max_patches_per_side} exceeds the tower's "
                f"2D RoPE grid ({ROPE_MAX_GRID} patches per side)"
            )

    @property
    def unit(self) -> int:
        """Pixels per merged token side: both padded sides are multiples of this."""
        return self.patch_size * self.merge_size

    @classmethod
    def for_vision(cls, vision: VisionConfig, **overrides: Any) -> "MediaConfig":
        """Settings whose patch size, merge size and chunk length match the tower `vision`."""
        kh, kw = vision.merge_kernel
        if kh != kw:
            raise ValueError(f"preprocessing needs a square merge kernel, got {vision.merge_kernel}")
        base = dict(patch_size=vision.patch_size, merge_size=kh, frames_per_chunk=vision.pos_emb_time)
        return cls(**(base | overrides))

    def to_preprocessor_config(self) -> dict[str, Any]:
        """The `preprocessor_config.json` object `from_preprocessor_config` reads back as this config
        (the `media_proc_cfg` keys; the byte and pixel limits are the server's, not the checkpoint's)."""
        return {"media_proc_cfg": {
            "patch_size": self.patch_size,
            "merge_kernel_size": [self.merge_size, self.merge_size],
            "in_patch_limit": self.max_patches,
            "patch_limit_on_one_side": self.max_patches_per_side,
            "in_patch_limit_each_frame": self.video_max_patches_per_frame,
            "temporal_merge_kernel_size": self.frames_per_chunk,
            "sample_fps": self.video_fps,
            "max_num_frames_each_video": self.video_max_frames,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }}

    @classmethod
    def from_preprocessor_config(cls, data: dict[str, Any], **overrides: Any) -> "MediaConfig":
        """From a parsed `preprocessor_config.json` (`media_proc_cfg` nested or flat)."""
        if not isinstance(data, dict):
            raise ValueError(f"preprocessor config must be a JSON object, got {type(data).__name__}")
        cfg = data.get("media_proc_cfg", data)
        keys = {
            "patch_size": "patch_size",
            "merge_kernel_size": "merge_size",
            "in_patch_limit": "max_patches",
            "patch_limit_on_one_side": "max_patches_per_side",
            "in_patch_limit_each_frame": "video_max_patches_per_frame",
            "temporal_merge_kernel_size": "frames_per_chunk",
            "sample_fps": "video_fps",
            "max_num_frames_each_video": "video_max_frames",
            "image_mean": "image_mean",
            "image_std": "image_std",
        }
        values: dict[str, Any] = {}
        for src, dst in keys.items():
            if cfg.get(src) is None:
                continue
            val = cfg[src]
            if src == "merge_kernel_size" and isinstance(val, (list, tuple)):
                if len(set(val)) != 1:
                    raise ValueError(f"media_proc_cfg.merge_kernel_size must be square, got {val!r}")
                val = val[0]
            values[dst] = tuple(val) if dst in ("image_mean", "image_std") else val
        return cls(**(values | overrides))
