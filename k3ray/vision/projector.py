"""PatchMergerMLPV2 (docs/k3-architecture.md §7.3 step 5), published names under `mm_projector.`:
proj.0 (Linear, no bias) -> proj.1 GELU (exact erf) -> proj.2 (Linear, no bias) -> post_norm (RMSNorm).
K2.5's projector instead normalises first (LayerNorm `pre_norm`) and has biases."""

from __future__ import annotations

import torch
from torch import nn

from k3ray.vision.norm import VisionRMSNorm


class PatchMergerMLPV2(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Sequential(
            nn.Linear(in_dim, in_dim, bias=False, dtype=dtype),
            nn.GELU(),
            nn.Linear(in_dim, out_dim, bias=False, dtype=dtype),
        )
        self.post_norm = VisionRMSNorm(out_dim, eps, dtype)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        """merged [M, kh*kw*D] -> [M, text_hidden]."""
        return self.post_norm(self.proj(merged))
