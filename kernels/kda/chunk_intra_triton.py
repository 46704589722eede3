"""Triton KDA prefill, phase 1 of 3: everything inside one chunk, one program per (chunk, head).

Writes the in-chunk cumulative decay G, the WY factors W = T (exp(G) k) and U = T v with
T = (I + L)^-1 diag(beta), and A_qk. The decay-weighted products use the factorised sub-chunk
scheme of chunk_cpu.intra_chunk (kernels/kda/README.md), so no [C, C, K] exponent tile is formed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H: tl.constexpr, BT: tl.constexpr):
    """Packed chunk i_c at head i_h -> (offsets o_t [BT], mask m_t [BT] of real tokens, row offsets
    into [T, H, *] [BT], tokens left in the sequence from the chunk's start)."""
    i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    o_t = tl.arange(0, BT)
    return o_t, t0 + o_t < eos, (t0 + o_t) * H + i_h, eos - t0


@triton.jit
def chunk_kda_fwd_kernel_intra(
    q, k, v, g, beta, G_out, W_out, U_out, Aqk_out, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    o_t, m_t, rows, left = chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
    b_beta = tl.load(beta + rows, mask=m_t, other=0.0).to(tl.float32)

    b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
    b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = rows[:, None] * K + o_k[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32) * scale
        b_G = tl.cumsum(tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32), 0)  # [BT, BK]
        tl.store(G_out + p_tk, b_G, mask=m_tk)
        for i_b in range(0, BT // BC):
            e = i_b * BC + BC - 1
            m_in = (o_t >= i_b * BC) & (o_t <= e)
            m_from = o_t >= i_b * BC
            b_ref = tl.sum(tl.where((o_t == e)[:, None], b_G, 0.0), 0)  # [BK] decay at the block's last row
            b_right = tl.where(m_in[:, None], b_k * tl.exp(tl.where(m_in[:, None], b_ref[None, :] - b_G, 0.0)), 0.0)
            b_left = tl.exp(tl.where(m_from[:, None], b_G - b_ref[None, :], float("-inf")))
            b_Akk += tl.dot(b_k * b_left, tl.trans(b_right), input_precision=DOT)
            b_Aqk += tl.dot(b_q * b_left, tl.trans(b_right), input_precision=DOT)

    b_L = tl.where(o_t[:, None] > o_t[None, :], b_Akk * b_beta[:, None], 0.0)
    b_Aqk = tl.where(o_t[:, None] >= o_t[None, :], b_Aqk, 0.0)
    tl.store(Aqk_out + rows[:, None] * BT + o_t[None, :], b_Aqk, mask=m_t[:, None])

    # forward substitution: X = (I + L)^-1 - I, row i = -L[i] - L[i] X
    b_X = tl.zeros([BT, BT], dtype=tl.float32)
    for i in range(1, tl.minimum(left, BT)):
        b_a = -tl.sum(tl.where((o_t == i)[:, None], b_L, 0.0), 0)
        b_x = b_a + tl.sum(b_a[:, None] * b_X, 0)
        b_X = tl.where((o_t == i)[:, None], b_x[None, :], b_X)

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_tk = rows[:, None] * K + o_k[None, :]
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_G = tl.cumsum(tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32), 0)
        b_kb = b_k * tl.exp(b_G) * b_beta[:, None]
        b_W = b_kb + tl.dot(b_X, b_kb, input_precision=DOT)
        tl.store(W_out + p_tk, b_W, mask=m_tk)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = rows[:, None] * V + o_v[None, :]
        b_vb = tl.load(v + p_tv, mask=m_tv, other=0.0).to(tl.float32) * b_beta[:, None]
        b_U = b_vb + tl.dot(b_X, b_vb, input_precision=DOT)
        tl.store(U_out + p_tv, b_U, mask=m_tv)
