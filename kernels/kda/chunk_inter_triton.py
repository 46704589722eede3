"""Triton KDA prefill, phases 2 and 3: the chunk-to-chunk state recurrence (sequential over one
sequence's chunks, parallel over sequences, heads and value blocks), then every chunk's output."""

from __future__ import annotations

import triton
import triton.language as tl

from k3ray.kernels.kda.chunk_intra_triton import chunk_rows


@triton.jit
def chunk_kda_fwd_kernel_state(
    k, G, W, U, v_new, h, initial_state, final_state, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, DOT: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    o_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_S += tl.load(initial_state + (i_n * H + i_h) * (K * V) + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        tl.store(h + ((c0 + i_t) * H + i_h) * (K * V) + o_kv, b_S, mask=m_kv)
        t0 = bos + i_t * BT
        m_t = t0 + o_t < eos
        rows = (t0 + o_t) * H + i_h
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(W + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(U + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_vn = b_u - tl.dot(b_w, b_S, input_precision=DOT)  # [BT, BV]
        tl.store(v_new + rows[:, None] * V + o_v[None, :], b_vn, mask=m_tv)
        last = tl.minimum(eos, t0 + BT) - 1
        b_Gl = tl.load(G + (last * H + i_h) * K + o_k, mask=m_k, other=0.0)  # [BK] decay over the chunk
        b_G = tl.load(G + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(k + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_kd = b_k * tl.exp(tl.where(m_tk, b_Gl[None, :] - b_G, float("-inf")))
        b_S = b_S * tl.exp(b_Gl)[:, None] + tl.dot(tl.trans(b_kd), b_vn, input_precision=DOT)
    tl.store(final_state + (i_n * H + i_h) * (K * V) + o_kv, b_S, mask=m_kv)


@triton.jit
def chunk_kda_fwd_kernel_o(
    q, G, h, Aqk, v_new, o, cu_seqlens, chunk_indices, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT: tl.constexpr,
):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t, m_t, rows, _ = chunk_rows(cu_seqlens, chunk_indices, i_c, i_h, H, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    p_h = h + (i_c * H + i_h).to(tl.int64) * (K * V)
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
        b_G = tl.load(G + rows[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_S = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_q * tl.exp(b_G), b_S, input_precision=DOT)
    b_A = tl.load(Aqk + rows[:, None] * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    b_vn = tl.load(v_new + rows[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_o += tl.dot(b_A, b_vn, input_precision=DOT)
    tl.store(o + rows[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
