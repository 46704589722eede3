"""The MoonViT3d tower as K3 uses it (docs/k3-architecture.md §7.2-7.3), eager PyTorch with the published names
under `vision_tower.`: patch_embed.{proj, pos_emb}, encoder.blocks.{i}.{norm0, wqkv, wo, norm1,
mlp.fc0, mlp.fc1}, encoder.final_layernorm. No biases anywhere; RMSNorm (eps 2^-7) instead of
K2.5's LayerNorm; the qkv width (1536 in K3) is decoupled from the hidden width (1024).

Input is NaViT-packed: pixel_values [sum t*h*w, 3, p, p] and a grid of (t, h, w) chunks, each chunk's
patches frame-major then raster. Attention is bidirectional and never crosses a chunk boundary.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from k3ray.config import VISION_NORM_EPS, VisionConfig
from k3ray.vision.norm import VisionRMSNorm
from k3ray.vision.pos_emb import DividedFixedPosEmb
from k3ray.vision.rope2d import apply_rope2d, rope2d_angles

Grid = list[tuple[int, int, int]]


def chunk_bounds(grid: Grid) -> list[int]:
    """cu_seqlens of the packed chunks: [0, n_0, n_0 + n_1, ...] with n = t * h * w."""
    return list(itertools.accumulate((t * h * w for t, h, w in grid), initial=0))


class PatchEmbed(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, c.hidden_size, c.patch_size, c.patch_size, bias=False, dtype=dtype)
        self.pos_emb = DividedFixedPosEmb(c.pos_emb_height, c.pos_emb_width, c.pos_emb_time, c.hidden_size, dtype)

    def forward(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        x = self.proj(pixel_values).flatten(1)  # [N, D]
        return self.pos_emb(x, grid)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.fc1 = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.norm0 = VisionRMSNorm(c.hidden_size, VISION_NORM_EPS, dtype)
        self.wqkv = nn.Linear(c.hidden_size, 3 * c.qkv_hidden_size, bias=False, dtype=dtype)
        self.wo = nn.Linear(c.qkv_hidden_size, c.hidden_size, bias=False, dtype=dtype)
        self.norm1 = VisionRMSNorm(c.hidden_size, VISION_NORM_EPS, dtype)
        self.mlp = VisionMLP(c.hidden_size, c.intermediate_size, dtype)

    def attention(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)  # [N, H, d] each
        q, k = apply_rope2d(q, cos, sin), apply_rope2d(k, cos, sin)
        out = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            qc, kc, vc = (z[start:end].transpose(0, 1)[None] for z in (q, k, v))  # [1, H, L, d]
            o = F.scaled_dot_product_attention(qc, kc, vc, scale=1.0 / math.sqrt(self.head_dim))
            out.append(o[0].transpose(0, 1))  # [L, H, d]
        return torch.cat(out).flatten(1)  # [N, H*d]

    def forward(self, x: torch.Tensor, bounds: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.wo(self.attention(self.norm0(x), bounds, cos, sin))
        return x + self.mlp(self.norm1(x))


class VisionBlockStack(nn.Module):
    """The tower's blocks and final norm: `encoder.*` in the published names."""

    def __init__(self, c: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.head_dim = c.head_dim
        self.blocks = nn.ModuleList(VisionBlock(c, dtype) for _ in range(c.num_layers))
        self.final_layernorm = VisionRMSNorm(c.hidden_size, VISION_NORM_EPS, dtype)

    def forward(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        angles = rope2d_angles(grid, self.head_dim).to(x.device)  # [N, d/2]
        cos, sin = angles.cos(), angles.sin()
        bounds = chunk_bounds(grid)
        for block in self.blocks:
            x = block(x, bounds, cos, sin)
        return self.final_layernorm(x)


class MoonViT3d(nn.Module):
    """pixel_values [N, 3, p, p] + grid -> per-patch features [N, hidden] (before merging)."""

    def __init__(self, c: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(c, dtype)
        self.encoder = VisionBlockStack(c, dtype)

    def forward(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        return self.encoder(self.patch_embed(pixel_values, grid), grid)
