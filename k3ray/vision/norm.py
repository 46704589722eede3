"""RMSNorm as the K3 vision reference uses it (`nn.RMSNorm`): normalise and scale in fp32, then cast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
