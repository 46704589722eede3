"""Vectorised CPU AttnRes + RMSNorm: scores from one norm and one matvec per source (no
normalised-key copy of the sources), the mix as one batched matmul."""

from __future__ import annotations

import torch


def attn_res_rmsnorm_cpu(
    sources: torch.Tensor,
    proj_weight: torch.Tensor,
    res_norm_weight: torch.Tensor,
    out_norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sources [T, R, D] -> (aggregated [T, D], its KimiRMSNorm with out_norm_weight or None)."""
    D = sources.shape[-1]
    v32 = sources.float()
    w_eff = res_norm_weight.float() * proj_weight.reshape(-1).float()  # [D]
    ms = torch.linalg.vector_norm(v32, dim=-1).square_().div_(D)  # [T, R] mean square
    score = (v32 @ w_eff).mul_(torch.rsqrt(ms.add_(eps)))  # <v / rms(v), w_eff>
    p = score.softmax(-1)
    h = torch.bmm(p[:, None, :], v32).squeeze(1).to(sources.dtype)  # [T, D]
    if out_norm_weight is None:
        return h, None
    h32 = h.float()
    rstd = torch.rsqrt(torch.linalg.vector_norm(h32, dim=-1, keepdim=True).square_().div_(D).add_(eps))
    return h, out_norm_weight * (h32 * rstd).to(h.dtype)
