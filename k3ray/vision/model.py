"""K3's vision side as one module: `vision_tower` (MoonViT3d) + `mm_projector` (PatchMergerMLPV2).
Its state_dict names are the published checkpoint names. `encode_media` is the entry point:
packed pixel_values + grid_thws -> one text-width embedding per media placeholder token."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import nn

from k3ray.config import ROPE_MAX_GRID, VisionConfig
from k3ray.vision.merger import tpool_patch_merger
from k3ray.vision.projector import PatchMergerMLPV2
from k3ray.vision.tower import MoonViT3d

Grid = list[tuple[int, int, int]]


class K3VisionModel(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = MoonViT3d(config, dtype)
        self.mm_projector = PatchMergerMLPV2(
            config.merged_hidden_size, config.text_hidden_size, config.projector_ln_eps, dtype
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_tower.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        """[N, 3, p, p] packed patches -> [sum (h/kh)*(w/kw), text_hidden] (no input checks)."""
        hidden = self.vision_tower(pixel_values, grid)  # [N, D]
        merged = tpool_patch_merger(hidden, grid, self.config.merge_kernel)  # [M, kh*kw*D]
        return self.mm_projector(merged)


def checked_grid(config: VisionConfig, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence) -> Grid:
    """Validate a packed batch against the tower; returns the grid as (t, h, w) tuples."""
    grid = torch.as_tensor(grid_thws)
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or grid.is_floating_point():
        raise ValueError(
            f"grid_thws must be a non-empty integer [n_chunks, 3] tensor, got {tuple(grid.shape)} {grid.dtype}"
        )
    p = config.patch_size
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p) or not pixel_values.is_floating_point():
        raise ValueError(
            f"pixel_values must be a float [N, 3, {p}, {p}] tensor, "
            f"got {tuple(pixel_values.shape)} {pixel_values.dtype}"
        )
    kh, kw = config.merge_kernel
    out: Grid = []
    for i, (t, h, w) in enumerate(grid.tolist()):
        if not 1 <= t <= config.pos_emb_time:
            raise ValueError(f"grid_thws[{i}] has t={t} frames; a chunk holds 1..{config.pos_emb_time}")
        if h <= 0 or w <= 0 or h % kh or w % kw:
            raise ValueError(f"grid_thws[{i}] = ({t}, {h}, {w}): h and w must be positive multiples of {kh} and {kw}")
        if max(h, w) > ROPE_MAX_GRID:
            raise ValueError(
                f"grid_thws[{i}] = ({t}, {h}, {w}) exceeds the 2D RoPE grid of {ROPE_MAX_GRID} patches per side"
            )
        out.append((t, h, w))
    total = sum(t * h * w for t, h, w in out)
    if total != pixel_values.shape[0]:
        raise ValueError(f"grid_thws covers {total} patches but pixel_values holds {pixel_values.shape[0]}")
    return out


@torch.no_grad()
def encode_media(model: K3VisionModel, pixel_values: torch.Tensor, grid_thws: torch.Tensor | Sequence) -> torch.Tensor:
    """Packed media -> [n_tokens, text_hidden] in the model dtype, one row per placeholder token, items in
    order (n_tokens = sum over chunks of (h/kh)*(w/kw))."""
    grid = checked_grid(model.config, pixel_values, grid_thws)
    weight = model.vision_tower.patch_embed.proj.weight
    return model(pixel_values.to(device=weight.device, dtype=weight.dtype), grid)


@torch.no_grad()
def init_random_vision_weights(model: K3VisionModel, seed: int = 0) -> K3VisionModel:
    """Deterministic random weights scaled to keep activations near unit size (tiny checkpoints, tests)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        module = name.rsplit(".", 2)[-2]
        if "norm" in module:
            std, mean = 0.1, 1.0
        elif module == "pos_emb":
            std, mean = 0.5, 0.0
        else:
            std, mean = 1.0 / math.sqrt(p[0].numel()), 0.0  # 1 / sqrt(fan_in)
        p.copy_((torch.randn(p.shape, generator=gen) * std + mean).to(p.dtype))
    return model


def build_vision_model(config: VisionConfig, dtype: torch.dtype = torch.float32, seed: int | None = 0,
                       device: torch.device | str | None = None) -> K3VisionModel:
    """A K3VisionModel built on `device` (None: torch's current default, normally the CPU),
    randomly initialised with `seed` (drawn on the CPU) or left as constructed if None."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = K3VisionModel(config, dtype)
    if seed is not None:
        init_random_vision_weights(model, seed)
    return model.eval()
