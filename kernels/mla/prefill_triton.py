"""Triton causal varlen attention for MLA prefill on expanded K/V (MHA mode).

Packed sequences: query rows cu_seqlens_q[i]:cu_seqlens_q[i+1] are the LAST positions of key
rows cu_seqlens_k[i]:cu_seqlens_k[i+1]. The 192-wide q/k head is split into two power-of-two
pieces (128 + 64) so no dot runs on padding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3ray.kernels.mla.launch_triton import MIN_DOT, pow2_at_least
from k3ray.kernels.triton_dots import dot_args

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def mla_prefill_fwd_kernel(
    q, k, v, o, cu_q, cu_k, tile_seq, tile_row,
    scale, DQK, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    BM: tl.constexpr, BN: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr,
    HAS_D2: tl.constexpr, DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(tile_seq + i_t)
    q0 = tl.load(tile_row + i_t)
    qs, qe = tl.load(cu_q + i_n).to(tl.int64), tl.load(cu_q + i_n + 1).to(tl.int64)
    ks, ke = tl.load(cu_k + i_n).to(tl.int64), tl.load(cu_k + i_n + 1).to(tl.int64)
    lq, lk = (qe - qs).to(tl.int32), (ke - ks).to(tl.int32)

    o_m = q0 + tl.arange(0, BM)  # query index within the sequence
    m_m = o_m < lq
    b_lim = lk - lq + o_m  # last key each query sees
    o_d1 = tl.arange(0, BD1)
    o_d2 = BD1 + tl.arange(0, BD2)
    o_dv = tl.arange(0, BDV)
    m_d1, m_d2, m_dv = o_d1 < DQK, o_d2 < DQK, o_dv < DV

    p_q = q + (qs + o_m[:, None]) * stride_qt + i_h * stride_qh
    b_q1 = tl.load(p_q + o_d1[None, :], mask=m_m[:, None] & m_d1[None, :], other=0.0)  # [BM, BD1]
    if DOT_F32:
        b_q1 = b_q1.to(tl.float32)
    if HAS_D2:
        b_q2 = tl.load(p_q + o_d2[None, :], mask=m_m[:, None] & m_d2[None, :], other=0.0)  # [BM, BD2]
        if DOT_F32:
            b_q2 = b_q2.to(tl.float32)

    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BDV], dtype=tl.float32)
    k_end = tl.minimum(lk, lk - lq + q0 + BM)
    for s in range(0, k_end, BN):
        o_n = s + tl.arange(0, BN)
        m_n = o_n < lk
        p_k = k + (ks + o_n[None, :]) * stride_kt + i_h * stride_kh
        b_k1 = tl.load(p_k + o_d1[:, None], mask=m_n[None, :] & m_d1[:, None], other=0.0)  # [BD1, BN]
        if DOT_F32:
            b_k1 = b_k1.to(tl.float32)
        b_s = tl.dot(b_q1, b_k1, input_precision=DOT_PREC)
        if HAS_D2:
            b_k2 = tl.load(p_k + o_d2[:, None], mask=m_n[None, :] & m_d2[:, None], other=0.0)  # [BD2, BN]
            if DOT_F32:
                b_k2 = b_k2.to(tl.float32)
            b_s += tl.dot(b_q2, b_k2, input_precision=DOT_PREC)
        m_s = m_n[None, :] & (o_n[None, :] <= b_lim[:, None])
        b_s = tl.where(m_s, b_s * scale, float("-inf"))  # [BM, BN]
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # rows past the sequence end
        b_alpha = tl.exp(b_m - b_m_safe)
        b_p = tl.exp(b_s - b_m_safe[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        p_v = v + (ks + o_n[:, None]) * stride_vt + i_h * stride_vh + o_dv[None, :]
        b_v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)  # [BN, BDV]
        if DOT_F32:
            b_v = b_v.to(tl.float32)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
        b_m = b_m_new

    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o = o + (qs + o_m[:, None]) * stride_ot + i_h * stride_oh + o_dv[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_m[:, None] & m_dv[None, :])


def _tiles(cu_seqlens_q: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query row) of every BLOCK_M query tile, for the whole packed batch."""
    lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).cpu()
    n_tiles = (lq + block_m - 1) // block_m
    seq = torch.repeat_interleave(torch.arange(lq.numel()), n_tiles)
    first = torch.cumsum(n_tiles, 0) - n_tiles
    row = (torch.arange(seq.numel()) - first[seq]) * block_m
    return seq.to(torch.int32), row.to(torch.int32)


def mla_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] packed -> o [Tq, H, Dv] (q's dtype)."""
    Tq, H, DQK = q.shape
    DV = v.shape[-1]
    if out is None:
        out = q.new_empty(Tq, H, DV)
    seq, row = _tiles(cu_seqlens_q, BLOCK_M)
    if seq.numel() == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    BD1 = max(MIN_DOT, 1 << (DQK.bit_length() - 1))  # largest power of two <= DQK
    BD2 = pow2_at_least(DQK - BD1)
    grid = (seq.numel(), H)
    mla_prefill_fwd_kernel[grid](
        q, k, v, out, cu_seqlens_q.to(q.device), cu_seqlens_k.to(q.device), seq.to(q.device), row.to(q.device),
        scale, DQK, DV,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        BM=BLOCK_M, BN=BLOCK_N, BD1=BD1, BD2=BD2, BDV=pow2_at_least(DV), HAS_D2=DQK > BD1,
        **dot_args(q), num_warps=4, num_stages=2,
    )
    return out
