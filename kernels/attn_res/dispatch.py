"""AttnRes entry points: sources [T, R, D] -> aggregated [T, D] (and its RMSNorm). Triton on
CUDA tensors, the vectorised PyTorch path on CPU tensors; references in naive.py."""

from __future__ import annotations

import torch

from k3ray.kernels.attn_res.attn_res_cpu import attn_res_rmsnorm_cpu
from k3ray.kernels.attn_res.attn_res_triton import attn_res_rmsnorm_triton


def _check(sources: torch.Tensor, *weights: torch.Tensor) -> None:
    if sources.dim() != 3:
        raise ValueError(f"sources must be [T, R, D], got {list(sources.shape)}")
    if sources.shape[1] == 0:
        raise ValueError("sources must hold at least one source (R >= 1), got R = 0")
    D = sources.shape[-1]
    for w in weights:
        if w.numel() != D:
            raise ValueError(f"every weight must hold D = {D} values, got one of shape {list(w.shape)}")


def _impl(sources, proj_weight, res_norm_weight, out_norm_weight, eps):
    if sources.is_cuda:
        return attn_res_rmsnorm_triton(sources, proj_weight, res_norm_weight, out_norm_weight, eps)
    return attn_res_rmsnorm_cpu(sources, proj_weight, res_norm_weight, out_norm_weight, eps)


def attn_res(sources: torch.Tensor, proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(sources, proj_weight, norm_weight)
    return _impl(sources, proj_weight, norm_weight, None, eps)[0]


def attn_res_rmsnorm(
    sources: torch.Tensor,
    proj_weight: torch.Tensor,
    res_norm_weight: torch.Tensor,
    out_norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnRes, then the layer's RMSNorm (out_norm_weight): returns (aggregated, normed)."""
    _check(sources, proj_weight, res_norm_weight, out_norm_weight)
    return _impl(sources, proj_weight, res_norm_weight, out_norm_weight, eps)
