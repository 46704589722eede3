"""Reference Stable LatentMoE pieces: sigmoid + bias top-k routing, the SiTU-GLU activation and
a readable per-expert loop over (optionally MXFP4) expert weights.
"""

from __future__ import annotations

import torch

from k3ray.kernels.moe.mxfp4 import dequantize_mxfp4


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU(g, u) = beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta), fp32 math."""
    g32, u32 = g.float(), u.float()
    out = beta * torch.tanh(g32 / beta) * torch.sigmoid(g32) * (linear_beta * torch.tanh(u32 / linear_beta))
    return out.to(g.dtype)


def naive_select_experts(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32 gate GEMM output) -> (weights [T, k] fp32, ids [T, k] int64).

    The correction bias affects selection only; weights are the plain sigmoid scores."""
    s = torch.sigmoid(logits.float())
    ids = torch.topk(s + bias.float(), top_k, dim=-1, sorted=True).indices
    w = s.gather(-1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, ids


def expert_weight(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's [out, in] weight from a stacked tensor [E, out, in] or MXFP4 (packed, scale)."""
    if isinstance(w, tuple):
        return dequantize_mxfp4(w[0][e], w[1][e], dtype)
    return w[e].to(dtype)


def naive_moe_experts(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1, w3, w2,
    beta: float,
    linear_beta: float,
    expert_offset: int = 0,
) -> torch.Tensor:
    """y [T, Dl] fp32 = sum_k weights[:, k] * E_{ids[:, k]}(h) over the experts held here
    (ids in [expert_offset, expert_offset + E_local)); other ids contribute nothing.

    h [T, Dl]; w1, w3 [E_local, I, Dl]; w2 [E_local, Dl, I] (each a tensor or an MXFP4 pair).
    Each expert's output is cast to h's dtype, then weighted and summed in fp32 (HF reference)."""
    E_local = (w1[0] if isinstance(w1, tuple) else w1).shape[0]
    y = h.new_zeros(h.shape[0], h.shape[1], dtype=torch.float32)
    local = ids - expert_offset
    for e in range(E_local):
        tok, slot = (local == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        x = h[tok]
        a = situ_glu(x @ expert_weight(w1, e, h.dtype).T, x @ expert_weight(w3, e, h.dtype).T, beta, linear_beta)
        out = a @ expert_weight(w2, e, h.dtype).T
        y.index_add_(0, tok, out.float() * weights[tok, slot, None].float())
    return y
