"""Triton AttnRes fused with the RMSNorm that follows it: one program per token row.

Pass 1 reads the R <= 9 sources once for their sums of squares and their dot with the
effective query (score_r = rstd_r * <v_r, w_eff>, the same as <k_r, w_eff>); pass 2 writes
h = sum_r p_r v_r and its sum of squares; pass 3 re-reads h to write the normed output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 1024  # channels a program step when there are few token rows (decode): wide steps, 8 warps
# many rows (prefill): 256-channel steps at 4 warps take 56 registers at R = 9 (1024 at 8 warps: 145),
# so 9 programs share a multiprocessor instead of 1 and keep ~5x the bytes in flight
MANY_ROWS, BLOCK_D_MANY_ROWS = 512, 256


@triton.jit
def attn_res_fwd_kernel(
    v, w_proj, w_res, w_out, h, y,
    D, R, eps,
    stride_vt, stride_vr, stride_ht, stride_yt,
    BR: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_r = tl.arange(0, BR)
    m_r = o_r < R
    p_v = v + i_t * stride_vt + o_r[:, None] * stride_vr
    b_ss = tl.zeros([BR], dtype=tl.float32)
    b_dot = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < D
        b_v = tl.load(p_v + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BR, BD]
        b_w = tl.load(w_res + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_w *= tl.load(w_proj + o_d, mask=m_d, other=0.0).to(tl.float32)  # effective query w_eff
        b_ss += tl.sum(b_v * b_v, 1)
        b_dot += tl.sum(b_v * b_w[None, :], 1)
    b_score = tl.where(m_r, b_dot * tl.rsqrt(b_ss / D + eps), float("-inf"))
    b_p = tl.exp(b_score - tl.max(b_score, 0))
    b_p = b_p / tl.sum(b_p, 0)  # [BR]

    b_hss = tl.zeros([BD], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < D
        b_v = tl.load(p_v + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_h = tl.sum(b_p[:, None] * b_v, 0).to(h.dtype.element_ty)  # [BD]
        tl.store(h + i_t * stride_ht + o_d, b_h, mask=m_d)
        b_h32 = b_h.to(tl.float32)
        b_hss += b_h32 * b_h32
    if NORM:
        b_rstd = tl.rsqrt(tl.sum(b_hss, 0) / D + eps)
        tl.debug_barrier()  # pass 3 reads h written by other threads of this program
        for d0 in range(0, D, BD):
            o_d = d0 + tl.arange(0, BD)
            m_d = o_d < D
            b_h32 = tl.load(h + i_t * stride_ht + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_n = (b_h32 * b_rstd).to(h.dtype.element_ty).to(tl.float32)  # KimiRMSNorm: cast back, then weight
            b_wo = tl.load(w_out + o_d, mask=m_d, other=0.0).to(tl.float32)
            tl.store(y + i_t * stride_yt + o_d, (b_wo * b_n).to(y.dtype.element_ty), mask=m_d)


def attn_res_rmsnorm_triton(
    sources: torch.Tensor,
    proj_weight: torch.Tensor,
    res_norm_weight: torch.Tensor,
    out_norm_weight: torch.Tensor | None,
    eps: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sources [T, R, D] -> (aggregated [T, D] in sources' dtype, its RMSNorm with out_norm_weight
    in the promoted dtype, or None when out_norm_weight is None)."""
    T, R, D = sources.shape
    v = sources if sources.stride(-1) == 1 else sources.contiguous()
    norm = out_norm_weight is not None
    y_dtype = torch.promote_types(out_norm_weight.dtype, sources.dtype) if norm else sources.dtype
    h, y = out if out is not None else (v.new_empty(T, D), v.new_empty(T, D, dtype=y_dtype) if norm else None)
    if T == 0:
        return h, y
    many = T >= MANY_ROWS
    block_d = BLOCK_D_MANY_ROWS if many else BLOCK_D
    num_warps = 4 if many or D < 4096 else 8
    attn_res_fwd_kernel[(T,)](
        v, proj_weight.reshape(-1), res_norm_weight, out_norm_weight if norm else res_norm_weight, h,
        y if norm else h, D, R, eps,
        v.stride(0), v.stride(1), h.stride(0), y.stride(0) if norm else 0,
        BR=max(2, triton.next_power_of_2(R)), BD=min(block_d, triton.next_power_of_2(D)), NORM=norm,
        num_warps=num_warps,
    )
    return h, y
