"""Triton expert selection (sigmoid + bias top-k, fp32): one program per token row, k rounds of argmax."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def select_experts_fwd_kernel(
    logits, bias, weights, ids,
    E, scaling, stride_lt,
    TOP_K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, RENORM: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_x = tl.load(logits + i_t * stride_lt + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_t = tl.exp(-tl.abs(b_x))  # a sigmoid that never overflows
    b_s = tl.where(b_x >= 0, 1.0 / (1.0 + b_t), b_t / (1.0 + b_t))  # [BE]
    b_c = tl.where(m_e, b_s + tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32), float("-inf"))
    o_k = tl.arange(0, BK)
    b_w = tl.zeros([BK], dtype=tl.float32)
    b_i = tl.zeros([BK], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        b_best = tl.max(b_c, 0)
        i_best = tl.min(tl.where(b_c == b_best, o_e, BE), 0)  # lowest index among ties
        b_w = tl.where(o_k == j, tl.sum(tl.where(o_e == i_best, b_s, 0.0), 0), b_w)
        b_i = tl.where(o_k == j, i_best, b_i)
        b_c = tl.where(o_e == i_best, float("-inf"), b_c)
    if RENORM:
        b_w = b_w / (tl.sum(b_w, 0) + 1e-20)
    m_k = o_k < TOP_K
    tl.store(weights + i_t * TOP_K + o_k, b_w * scaling, mask=m_k)
    tl.store(ids + i_t * TOP_K + o_k, b_i.to(tl.int64), mask=m_k)


def select_experts_triton(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    scaling: float = 1.0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, ids [T, k] int64), ids by descending biased score."""
    T, E = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights, ids = out if out is not None else (
        torch.empty(T, top_k, dtype=torch.float32, device=x.device),
        torch.empty(T, top_k, dtype=torch.int64, device=x.device),
    )
    if T == 0:
        return weights, ids
    BE = triton.next_power_of_2(E)
    select_experts_fwd_kernel[(T,)](
        x, bias, weights, ids, E, scaling, x.stride(0),
        TOP_K=top_k, BE=BE, BK=max(2, triton.next_power_of_2(top_k)), RENORM=renormalize,
        num_warps=4 if BE <= 1024 else 8,
    )
    return weights, ids
