"""RMSNorm as K3 uses it: normalise in fp32, cast back, then multiply by the weight."""

from __future__ import annotations

import torch
from torch import nn

from k3ray.kernels.attn_res.naive import naive_rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return naive_rms_norm(x, self.weight, self.eps)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA's FusedRMSNormGated(sigmoid): x * rstd * weight * sigmoid(gate), all in fp32."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y * torch.sigmoid(gate.float())
