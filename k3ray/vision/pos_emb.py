"""MoonViT3d's `divided_fixed` absolute position term (docs/k3-architecture.md §7.3 step 2).

Spatial: a learnable [H0, W0, D] grid, used as-is when a chunk is H0 x W0 patches and otherwise
resampled with `F.interpolate(mode="bilinear", align_corners=False)` to (h, w). Temporal: for chunks of
t > 1 frames, frame f also gets the fixed 1D sin/cos embedding `[sin(f w_i) | cos(f w_i)]`,
w_i = 10000^(-2i/D); single-frame chunks (images) get none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3ray.config import TEMPORAL_THETA

Grid = list[tuple[int, int, int]]


def temporal_sincos(dim: int, num_frames: int, device: torch.device | None = None) -> torch.Tensor:
    """[num_frames, dim] float32: row f = [sin(f * w_0..) | cos(f * w_0..)], w_i = 10000^(-2i/dim)."""
    assert dim % 2 == 0, dim
    omega = TEMPORAL_THETA ** -(torch.arange(dim // 2, dtype=torch.float64, device=device) / (dim // 2))
    angles = torch.arange(num_frames, dtype=torch.float64, device=device)[:, None] * omega  # [t, D/2]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


class DividedFixedPosEmb(nn.Module):
    def __init__(self, height: int, width: int, num_frames: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_frames = num_frames
        self.weight = nn.Parameter(torch.zeros(height, width, dim, dtype=dtype))

    def spatial(self, h: int, w: int) -> torch.Tensor:
        """[h * w, D] in raster order, in the weight's dtype."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        grid = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
        return grid[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        """x [N, D] packed chunks (frame-major, then raster) -> x + position term."""
        parts = []
        for t, h, w in grid:
            assert t <= self.num_frames, (t, self.num_frames)
            pos = self.spatial(h, w)  # [h*w, D]
            if t > 1:
                time = temporal_sincos(pos.shape[-1], t, pos.device)  # [t, D] fp32
                pos = (pos[None] + time[:, None]).flatten(0, 1)  # [t*h*w, D]
            parts.append(pos.to(x.dtype))
        return x + torch.cat(parts)
