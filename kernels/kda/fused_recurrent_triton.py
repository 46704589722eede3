"""Triton KDA recurrence over a state pool: decode (one token per sequence, its slot updated in
place) and speculative verification (the state after every token stored to its own slot)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def fused_recurrent_kda_fwd_kernel(
    q, k, v, g, beta, o, state_pool, initial_slots, cu_seqlens, out_slots, stride_out_slots, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    o_kv = o_k[:, None] * V + o_v[None, :]  # [BK, BV] offsets inside one [K, V] state
    # (the interpreter rejects scalar & block masks, hence `o_v * 0 + scalar`)
    slot0 = tl.load(initial_slots + i_n).to(tl.int64)
    p_S0 = state_pool + (tl.maximum(slot0, 0) * H + i_h) * (K * V) + o_kv
    b_S = tl.load(p_S0, mask=m_k[:, None] & (m_v & (o_v * 0 + slot0 >= 0))[None, :], other=0.0).to(tl.float32)
    for j in range(0, eos - bos):
        o_t = (bos + j) * H + i_h
        b_q = tl.load(q + o_t * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + o_t * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + o_t * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + o_t * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + o_t).to(tl.float32)
        b_S = b_S * tl.exp(b_g)[:, None]  # decay scales key-dim rows
        b_u = b_beta * (b_v - tl.sum(b_k[:, None] * b_S, 0))  # [BV]
        b_S += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_q[:, None] * b_S, 0)
        tl.store(o + o_t * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        slot = tl.load(out_slots + i_n * stride_out_slots + j).to(tl.int64)
        p_S = state_pool + (tl.maximum(slot, 0) * H + i_h) * (K * V) + o_kv
        tl.store(p_S, b_S, mask=m_k[:, None] & (m_v & (o_v * 0 + slot >= 0))[None, :])


def fused_recurrent_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Same contract as fused_recurrent_cpu.fused_recurrent_kda_cpu -> o [T, H, V] in v's dtype."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    assert state_pool.is_contiguous() and state_pool.dtype == torch.float32, "state_pool must be contiguous fp32"
    assert state_pool.shape[1:] == (H, K, V), f"state_pool {list(state_pool.shape)} vs [*, {H}, {K}, {V}]"
    o = torch.empty_like(v)
    BK = triton.next_power_of_2(K)
    BV = min(32, triton.next_power_of_2(V))
    out_slots = out_slots.long()
    grid = (triton.cdiv(V, BV), N * H)
    if N:
        fused_recurrent_kda_fwd_kernel[grid](
            q, k, v, g, beta, o, state_pool, initial_slots.long().contiguous(),
            cu_seqlens.to(device=q.device, dtype=torch.long), out_slots.contiguous(),
            out_slots.shape[1] if out_slots.dim() == 2 else 1, scale,
            H=H, K=K, V=V, BK=BK, BV=BV,
        )
    return o
