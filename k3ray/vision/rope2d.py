"""2D rotary embedding of the MoonViT towers (`Rope2DPosEmbRepeated`, docs/k3-architecture.md §7.3).

A head of size d holds d/2 complex pairs (consecutive real, imag elements). Pair 2i rotates by
column * f_i and pair 2i+1 by row * f_i, with f_i = theta^(-4i/d) for i < d/4, so x and y
frequencies interleave. Every frame of a chunk repeats the same (row, column) table.
"""

from __future__ import annotations

import torch

from k3ray.config import ROPE_THETA

Grid = list[tuple[int, int, int]]


def rope2d_frequencies(head_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """[head_dim / 4] float32: f_i = theta^(-4i / head_dim)."""
    assert head_dim % 4 == 0, head_dim
    return 1.0 / theta ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim)


def rope2d_angles(grid: Grid, head_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """[N, head_dim / 2] float32 rotation angles for packed chunks (frame-major, then raster)."""
    freqs = rope2d_frequencies(head_dim, theta)
    parts = []
    for t, h, w in grid:
        rows = torch.arange(h).repeat_interleave(w).float()  # [h*w]
        cols = torch.arange(w).repeat(h).float()
        angles = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1)  # [h*w, d/4, (x, y)]
        parts.append(angles.flatten(1).repeat(t, 1))
    return torch.cat(parts)


def apply_rope2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, d] (pairs interleaved), cos/sin [N, d/2] -> x rotated, in fp32, cast back to x.dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [N, H, d/2, 2]
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2).to(x.dtype)
