"""`sd2_tpool` merging (docs/k3-architecture.md §7.3 step 4): per chunk, mean over its t frames, then each
kh x kw block of patches becomes one token of width kh * kw * D (row-major inside the block)."""

from __future__ import annotations

import torch

Grid = list[tuple[int, int, int]]


def tpool_patch_merger(x: torch.Tensor, grid: Grid, kernel: tuple[int, int]) -> torch.Tensor:
    """x [sum t*h*w, D] packed -> [sum (h/kh)*(w/kw), kh*kw*D], chunks in order, tokens in raster order."""
    kh, kw = kernel
    dim = x.shape[-1]
    out, offset = [], 0
    for t, h, w in grid:
        assert h % kh == 0 and w % kw == 0, (h, w, kernel)
        chunk = x[offset : offset + t * h * w].view(t, h // kh, kh, w // kw, kw, dim)
        pooled = chunk.permute(0, 1, 3, 2, 4, 5).mean(dim=0)  # [h/kh, w/kw, kh, kw, D]
        out.append(pooled.reshape(-1, kh * kw * dim))
        offset += t * h * w
    assert offset == x.shape[0], (offset, x.shape)
    return torch.cat(out)
