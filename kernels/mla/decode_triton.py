"""Triton absorbed MLA decode: one query token per sequence, MQA over the paged latent cache.

Flash-decoding: the context of each sequence is cut into NUM_SPLITS pieces, each program
attends a block of heads over one piece (every head shares the one 576-wide latent "KV head"),
and a second kernel merges the pieces with their log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3ray.kernels.mla.launch_triton import pow2_at_least
from k3ray.kernels.triton_dots import dot_args

BLOCK_H = 32  # heads per program: the latent pages are read once per 32 heads (tl.dot needs >= 16)
BLOCK_N = 32  # context tokens per inner step
MAX_SPLITS = 128
TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves


@triton.jit
def mla_decode_fwd_kernel_split(
    q, cache, block_tables, context_lens, o_part, lse_part, out,
    scale, H, L, R, block_size,
    stride_qn, stride_qh, stride_c, stride_bt,
    stride_pn, stride_ph, stride_ps, stride_on, stride_oh,
    NUM_SPLITS: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
    DIRECT: tl.constexpr, DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_n, i_hb, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n64 = i_n.to(tl.int64)
    ctx = tl.load(context_lens + i_n).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BN) * BN
    start = i_s * per_split
    end = tl.minimum(start + per_split, ctx)

    o_h = i_hb * BH + tl.arange(0, BH)
    o_l = tl.arange(0, BL)
    o_r = tl.arange(0, BR)
    m_h, m_l, m_r = o_h < H, o_l < L, o_r < R
    p_q = q + i_n64 * stride_qn + o_h[:, None].to(tl.int64) * stride_qh
    b_ql = tl.load(p_q + o_l[None, :], mask=m_h[:, None] & m_l[None, :], other=0.0)  # [BH, BL]
    b_qr = tl.load(p_q + L + o_r[None, :], mask=m_h[:, None] & m_r[None, :], other=0.0)  # [BH, BR]
    if DOT_F32:
        b_ql, b_qr = b_ql.to(tl.float32), b_qr.to(tl.float32)

    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, BL], dtype=tl.float32)
    for s in range(start, end, BN):
        o_t = s + tl.arange(0, BN)
        m_t = o_t < end
        b_blk = tl.load(block_tables + i_n64 * stride_bt + o_t // block_size, mask=m_t, other=0).to(tl.int64)
        o_slot = b_blk * block_size + (o_t % block_size)
        p_c = cache + o_slot[:, None] * stride_c
        b_kl = tl.load(p_c + o_l[None, :], mask=m_t[:, None] & m_l[None, :], other=0.0)  # [BN, BL]
        b_kr = tl.load(p_c + L + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)  # [BN, BR]
        if DOT_F32:
            b_kl, b_kr = b_kl.to(tl.float32), b_kr.to(tl.float32)
        b_s = tl.dot(b_ql, tl.trans(b_kl), input_precision=DOT_PREC)
        b_s += tl.dot(b_qr, tl.trans(b_kr), input_precision=DOT_PREC)
        b_s = tl.where(m_t[None, :], b_s * scale, float("-inf"))  # [BH, BN]
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_kl.dtype), b_kl, input_precision=DOT_PREC)
        b_m = b_m_new

    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]  # an empty context attends to nothing -> 0
    if DIRECT:
        p_o = out + i_n64 * stride_on + o_h[:, None].to(tl.int64) * stride_oh + o_l[None, :]
        tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_h[:, None] & m_l[None, :])
    else:
        p_o = o_part + i_n64 * stride_pn + o_h[:, None].to(tl.int64) * stride_ph + i_s * stride_ps + o_l[None, :]
        tl.store(p_o, b_o, mask=m_h[:, None] & m_l[None, :])
        b_lse = tl.where(b_l > 0, b_m + tl.log(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
        tl.store(lse_part + i_n64 * H * NUM_SPLITS + o_h * NUM_SPLITS + i_s, b_lse, mask=m_h)


@triton.jit
def mla_decode_fwd_kernel_combine(
    o_part, lse_part, out, H, L,
    stride_pn, stride_ph, stride_ps, stride_on, stride_oh,
    NUM_SPLITS: tl.constexpr, BS: tl.constexpr, BL: tl.constexpr,
):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    i_n64 = i_n.to(tl.int64)
    o_s = tl.arange(0, BS)
    o_l = tl.arange(0, BL)
    m_l = o_l < L
    b_lse = tl.load(lse_part + (i_n64 * H + i_h) * NUM_SPLITS + o_s, mask=o_s < NUM_SPLITS, other=float("-inf"))
    b_max = tl.max(b_lse, 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_lse - b_max)  # [BS]; empty splits weigh 0
    b_sum = tl.sum(b_w, 0)
    b_acc = tl.zeros([BL], dtype=tl.float32)
    p_part = o_part + i_n64 * stride_pn + i_h * stride_ph
    for s in range(NUM_SPLITS):
        b_ws = tl.sum(tl.where(o_s == s, b_w, 0.0), 0)
        b_acc += b_ws * tl.load(p_part + s * stride_ps + o_l, mask=m_l, other=0.0)
    b_o = b_acc / tl.where(b_sum > 0, b_sum, 1.0)
    tl.store(out + i_n64 * stride_on + i_h * stride_oh + o_l, b_o.to(out.dtype.element_ty), mask=m_l)


def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def default_num_splits(num_seqs: int, num_heads: int, max_context: int, sms: int) -> int:
    """Enough splits to fill `sms` multiprocessors without making any split shorter than TOKENS_PER_SPLIT."""
    programs = num_seqs * triton.cdiv(num_heads, BLOCK_H)
    by_occupancy = triton.cdiv(2 * sms, programs)
    by_length = triton.cdiv(max_context, TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def mla_decode_triton(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_latent [N, H, L + R] over cache [slots, L + R] (block_tables [N, B], context_lens [N])
    -> [N, H, L] in q_latent's dtype. num_splits defaults to a GPU-occupancy choice made from the
    block table's capacity (no device sync)."""
    N, H, D = q_latent.shape
    L, R = kv_lora_rank, D - kv_lora_rank
    assert cache.shape[-1] == D, f"cache width {cache.shape[-1]} != q width {D}"
    q = q_latent.contiguous()
    cache = cache if cache.stride(-1) == 1 else cache.contiguous()
    block_tables = block_tables.to(q.device)
    context_lens = context_lens.to(q.device)
    if out is None:
        out = q.new_empty(N, H, L)
    if N == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(N, H, block_tables.shape[1] * block_size, multiprocessors(q.device))
    BL, BR = pow2_at_least(L), pow2_at_least(R)
    direct = num_splits == 1
    o_part = out if direct else torch.empty(N, H, num_splits, L, dtype=torch.float32, device=q.device)
    lse_part = out if direct else torch.empty(N, H, num_splits, dtype=torch.float32, device=q.device)
    grid = (N, triton.cdiv(H, BLOCK_H), num_splits)
    mla_decode_fwd_kernel_split[grid](
        q, cache, block_tables, context_lens, o_part, lse_part, out,
        scale, H, L, R, block_size,
        q.stride(0), q.stride(1), cache.stride(0), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2) if not direct else 0, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BH=BLOCK_H, BN=BLOCK_N, BL=BL, BR=BR, DIRECT=direct,
        **dot_args(q), num_warps=8, num_stages=2,
    )
    if not direct:
        mla_decode_fwd_kernel_combine[(N, H)](
            o_part, lse_part, out, H, L,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BS=triton.next_power_of_2(num_splits), BL=BL, num_warps=4,
        )
    return out
