"""AttnRes entry points: sources [T, R, D] -> aggregated [T, D] (and its RMSNorm)."""

from __future__ import annotations

import torch

from k3ray.kernels.attn_res.naive import naive_attn_res, naive_attn_res_rmsnorm


def attn_res(sources: torch.Tensor, proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    return naive_attn_res(sources, proj_weight, norm_weight, eps)


def attn_res_rmsnorm(
    sources: torch.Tensor,
    proj_weight: torch.Tensor,
    res_norm_weight: torch.Tensor,
    out_norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return naive_attn_res_rmsnorm(sources, proj_weight, res_norm_weight, out_norm_weight, eps)
