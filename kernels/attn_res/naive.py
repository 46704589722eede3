"""Reference Block Attention Residual: a softmax over depth sources (bank + partial sum).

sources [T, R, D] (R <= 9 in K3); the keys are RMS-normalised sources without weight; the
effective query is norm.weight * proj.weight; values are the un-normalised sources.
"""

from __future__ import annotations

import torch


def naive_attn_res_logits(
    sources: torch.Tensor, proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """sources [T, R, D] -> the depth softmax's logits [T, R] (fp32)."""
    v32 = sources.float()
    k = v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)
    w_eff = norm_weight.float() * proj_weight.reshape(-1).float()  # [D]
    return (k * w_eff).sum(-1)


def naive_attn_res(
    sources: torch.Tensor, proj_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    p = naive_attn_res_logits(sources, proj_weight, norm_weight, eps).softmax(-1)  # [T, R]
    return (p[:, None, :] @ sources.float()).squeeze(1).to(sources.dtype)


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiRMSNorm: normalise in fp32, cast back, then multiply by the weight."""
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y


def naive_attn_res_rmsnorm(
    sources: torch.Tensor,
    proj_weight: torch.Tensor,
    res_norm_weight: torch.Tensor,
    out_norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnRes followed by the layer's RMSNorm: returns (aggregated, normed)."""
    h = naive_attn_res(sources, proj_weight, res_norm_weight, eps)
    return h, naive_rms_norm(h, out_norm_weight, eps)
