"""Triton grouped expert GEMMs for the Stable LatentMoE: SiTU-GLU experts over bf16/fp32 or MXFP4
weights (packed E2M1 nibbles + E8M0 group scales, dequantised in registers).

The (token, slot) pairs are sorted by local expert; every BLOCK_M rows of one expert form a
tile. Kernel 1: act = SiTU(h W1^T, h W3^T) per tile; kernel 2: y[token] += weight * act W2^T
(fp32 atomics). All tile bookkeeping stays on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3ray.kernels.moe.mxfp4 import GROUP
from k3ray.kernels.triton_dots import dot_args

BLOCK_N = 64
BLOCK_K = 2 * GROUP  # whole MXFP4 scale groups per K step
MAX_CHUNK_TOKENS = 4096  # bounds the [tokens * k, I] activation buffer
PACKED_GROUP = tl.constexpr(GROUP // 2)  # packed bytes sharing one E8M0 scale


@triton.jit
def _e8m0(b_s):
    """E8M0 code -> 2^(s - 127) in fp32, exactly (bit pattern; code 0 is the subnormal 2^-127)."""
    b_s = b_s.to(tl.int32)
    return tl.where(b_s == 0, 5.877471754111438e-39, (b_s << 23).to(tl.float32, bitcast=True))


@triton.jit
def _e2m1(b_c):
    """E2M1 nibble code [0, 16) -> value, exactly: {0, .5, 1, 1.5, 2, 3, 4, 6} with sign bit 3."""
    b_e = (b_c >> 1) & 3
    b_m = (b_c & 1).to(tl.float32)
    b_pow = tl.where(b_e == 3, 2.0, tl.where(b_e == 2, 1.0, 0.5))
    b_mag = tl.where(b_e == 0, 0.5 * b_m, (2.0 + b_m) * b_pow)
    return tl.where((b_c & 8) != 0, -b_mag, b_mag)


@triton.jit
def _sigmoid(x):
    b_t = tl.exp(-tl.abs(x))  # never overflows
    return tl.where(x >= 0, 1.0 / (1.0 + b_t), b_t / (1.0 + b_t))


@triton.jit
def _tanh(x):
    b_t = tl.exp(-2.0 * tl.abs(x))
    b_y = (1.0 - b_t) / (1.0 + b_t)
    return tl.where(x < 0, -b_y, b_y)


@triton.jit
def _matmul_tile(
    a, w, w_scale, o_row, m_row, o_n, m_n, K, stride_a, stride_wn, stride_sn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """[BM, BN] fp32 = a[o_row, :K] @ W[o_n, :K]^T, W dense [N, K] or MXFP4 ([N, K/2], [N, K/32])."""
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_end = tl.where(tl.max(m_row.to(tl.int32), 0) > 0, K, 0)  # tiles past the last expert do nothing
    p_a = a + o_row[:, None] * stride_a
    for k0 in range(0, k_end, BK):
        if MXFP4:
            o_j = k0 // 2 + tl.arange(0, BK // 2)  # packed byte columns
            m_j = o_j < K // 2
            m_a = m_row[:, None] & m_j[None, :]
            b_a0 = tl.load(p_a + 2 * o_j[None, :], mask=m_a, other=0.0)  # [BM, BK/2] even elements
            b_a1 = tl.load(p_a + 2 * o_j[None, :] + 1, mask=m_a, other=0.0)  # odd elements
            m_w = m_j[:, None] & m_n[None, :]
            b_b = tl.load(w + o_n[None, :] * stride_wn + o_j[:, None], mask=m_w, other=0).to(tl.int32)  # [BK/2, BN]
            p_sc = w_scale + o_n[None, :] * stride_sn + (o_j // PACKED_GROUP)[:, None]
            b_sc = _e8m0(tl.load(p_sc, mask=m_w, other=127))  # [BK/2, BN]
            b_w0 = (_e2m1(b_b & 15) * b_sc).to(b_a0.dtype)
            b_w1 = (_e2m1(b_b >> 4) * b_sc).to(b_a0.dtype)
            if DOT_F32:
                b_a0, b_a1 = b_a0.to(tl.float32), b_a1.to(tl.float32)
                b_w0, b_w1 = b_w0.to(tl.float32), b_w1.to(tl.float32)
            b_acc += tl.dot(b_a0, b_w0, input_precision=DOT_PREC)
            b_acc += tl.dot(b_a1, b_w1, input_precision=DOT_PREC)
        else:
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            b_a = tl.load(p_a + o_k[None, :], mask=m_row[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
            b_w = tl.load(w + o_n[None, :] * stride_wn + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
            b_w = b_w.to(b_a.dtype)
            if DOT_F32:
                b_a, b_w = b_a.to(tl.float32), b_w.to(tl.float32)
            b_acc += tl.dot(b_a, b_w, input_precision=DOT_PREC)
    return b_acc


@triton.jit
def moe_gate_up_fwd_kernel(
    h, w1, s1, w3, s3, act, pairs, tile_expert, tile_row0, tile_row1,
    beta, linear_beta, K, N, TOP_K,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_act,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    i_e = tl.load(tile_expert + i_t).to(tl.int64)
    o_r = tl.load(tile_row0 + i_t) + tl.arange(0, BM)  # rows of the expert-sorted pair list
    m_r = o_r < tl.load(tile_row1 + i_t)
    o_tok = (tl.load(pairs + o_r, mask=m_r, other=0) // TOP_K).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    b_g = _matmul_tile(h, w1 + i_e * stride_we, s1 + i_e * stride_se, o_tok, m_r, o_n, m_n, K, stride_h,
                       stride_wn, stride_sn, BM, BN, BK, MXFP4, DOT_F32, DOT_PREC)
    b_u = _matmul_tile(h, w3 + i_e * stride_we, s3 + i_e * stride_se, o_tok, m_r, o_n, m_n, K, stride_h,
                       stride_wn, stride_sn, BM, BN, BK, MXFP4, DOT_F32, DOT_PREC)
    # the reference rounds each projection to the activation dtype before SiTU
    b_g = b_g.to(act.dtype.element_ty).to(tl.float32)
    b_u = b_u.to(act.dtype.element_ty).to(tl.float32)
    b_a = beta * _tanh(b_g / beta) * _sigmoid(b_g) * (linear_beta * _tanh(b_u / linear_beta))
    p_act = act + o_r[:, None].to(tl.int64) * stride_act + o_n[None, :]
    tl.store(p_act, b_a.to(act.dtype.element_ty), mask=m_r[:, None] & m_n[None, :])


@triton.jit
def moe_down_fwd_kernel(
    act, w2, s2, y, pairs, route_w, tile_expert, tile_row0, tile_row1,
    K, N, TOP_K,
    stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_t, i_n = tl.program_id(0), tl.program_id(1)
    i_e = tl.load(tile_expert + i_t).to(tl.int64)
    o_r = tl.load(tile_row0 + i_t) + tl.arange(0, BM)
    m_r = o_r < tl.load(tile_row1 + i_t)
    o_pair = tl.load(pairs + o_r, mask=m_r, other=0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    b_o = _matmul_tile(act, w2 + i_e * stride_we, s2 + i_e * stride_se, o_r.to(tl.int64), m_r, o_n, m_n, K,
                       stride_act, stride_wn, stride_sn, BM, BN, BK, MXFP4, DOT_F32, DOT_PREC)
    b_rw = tl.load(route_w + o_pair, mask=m_r, other=0.0).to(tl.float32)
    b_o = b_o.to(act.dtype.element_ty).to(tl.float32) * b_rw[:, None]  # expert output in h's dtype, weighted in fp32
    p_y = y + (o_pair // TOP_K)[:, None] * stride_y + o_n[None, :]
    tl.atomic_add(p_y, b_o, mask=m_r[:, None] & m_n[None, :])


def _unpack_weight(w) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(weight, scale, is_mxfp4); a dense weight gets itself as an unused scale."""
    if isinstance(w, tuple):
        return w[0].contiguous(), w[1].contiguous(), True
    return w.contiguous(), w, False


def _tiles(key: torch.Tensor, num_experts: int, block_m: int):
    """Sort pairs by expert (key == num_experts marks pairs held elsewhere) and cut each expert's
    run into BLOCK_M-row tiles: (sorted pairs, tile expert, first row, end row), all on device."""
    P = key.numel()
    pairs = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=key.dtype, device=key.device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_experts]  # torch.bincount syncs on CUDA
    starts = torch.cumsum(counts, 0) - counts
    n_tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(n_tiles, 0)
    bound = min(P, triton.cdiv(P, block_m) + num_experts)  # every used tile holds >= 1 pair
    t = torch.arange(bound, device=key.device)
    e = torch.searchsorted(tile_end, t, right=True).clamp_(max=num_experts - 1)
    used = t < tile_end[-1]
    row0 = starts[e] + (t - (tile_end[e] - n_tiles[e])) * block_m
    row1 = torch.where(used, starts[e] + counts[e], 0)
    return pairs, e.to(torch.int32), torch.where(used, row0, 0).to(torch.int32), row1.to(torch.int32)


def moe_experts_triton(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1, w3, w2,
    beta: float,
    linear_beta: float,
    expert_offset: int = 0,
) -> torch.Tensor:
    """y [T, Dl] fp32 = sum_k weights[:, k] * E_{ids[:, k]}(h) over experts [expert_offset,
    expert_offset + E_local); w1, w3 [E, I, Dl], w2 [E, Dl, I], each dense or an MXFP4 pair."""
    T, Dl = h.shape
    top_k = ids.shape[1]
    w1, s1, mx = _unpack_weight(w1)
    w3, s3, _ = _unpack_weight(w3)
    w2, s2, _ = _unpack_weight(w2)
    E, I = w1.shape[0], w1.shape[1]
    h = h.contiguous()
    y = torch.zeros(T, Dl, dtype=torch.float32, device=h.device)
    dot = dot_args(h)
    block_m = 16 if T * top_k < 32 * E else 64  # few rows per expert (decode): small tiles
    for t0 in range(0, T, MAX_CHUNK_TOKENS):
        t1 = min(T, t0 + MAX_CHUNK_TOKENS)
        local = ids[t0:t1].reshape(-1).long() - expert_offset
        key = torch.where((local >= 0) & (local < E), local, E)
        pairs, tile_e, row0, row1 = _tiles(key, E, block_m)
        if pairs.numel() == 0:
            continue
        act = torch.empty(pairs.numel(), I, dtype=h.dtype, device=h.device)
        grid = (tile_e.numel(), triton.cdiv(I, BLOCK_N))
        moe_gate_up_fwd_kernel[grid](
            h[t0:t1], w1, s1, w3, s3, act, pairs, tile_e, row0, row1,
            beta, linear_beta, Dl, I, top_k,
            h.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), act.stride(0),
            BM=block_m, BN=BLOCK_N, BK=BLOCK_K, MXFP4=mx, **dot, num_warps=4,
        )
        grid = (tile_e.numel(), triton.cdiv(Dl, BLOCK_N))
        moe_down_fwd_kernel[grid](
            act, w2, s2, y[t0:t1], pairs, weights[t0:t1].reshape(-1).float().contiguous(), tile_e, row0, row1,
            I, Dl, top_k,
            act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
            BM=block_m, BN=BLOCK_N, BK=BLOCK_K, MXFP4=mx, **dot, num_warps=4,
        )
    return y

