"""Triton causal depthwise conv1d + SiLU over packed sequences, reading each sequence's initial
window from a state tensor at a per-sequence index and writing windows back at per-token or
per-sequence indices. One kernel serves prefill (final window), decode (roll one slot in place)
and speculative verification (the window after every token to its own slot)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3ray.kernels.kda.varlen import chunk_layout

PREFILL_BT = 16  # tokens per prefill program
TILE = 256  # tokens x channels per decode / verification program (at least 128 channels)


@triton.jit
def _conv_inputs(x, b_init, bos, L, o_r, o_d, m_d, D, W1: tl.constexpr, BW: tl.constexpr):
    """Inputs at local positions o_r [R] of one sequence -> [R, BD] fp32; a position p < 0 is row
    W1 + p of the initial window b_init [BW, BD]."""
    m_x = (o_r >= 0) & (o_r < L)
    p_x = x + (bos + o_r).to(tl.int64)[:, None] * D + o_d[None, :]
    b_x = tl.load(p_x, mask=m_x[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    m_sel = (W1 + o_r)[:, None, None] == tl.arange(0, BW)[None, :, None]  # [R, BW, 1]
    b_i = tl.sum(tl.where(m_sel, b_init[None, :, :], 0.0), 1)
    return tl.where((o_r < 0)[:, None], b_i, b_x)


@triton.jit
def causal_conv1d_fwd_kernel(
    x, weight, y, state_in, initial_idx, state_out, out_idx, cu_seqlens, block_indices,
    stride_in_s, stride_in_d, stride_out_s, stride_out_d, stride_out_idx, D,
    W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    WHOLE_SEQ: tl.constexpr, STORE_EVERY_TOKEN: tl.constexpr,
):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(block_indices + i_b * 2).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    if WHOLE_SEQ:
        t_begin = 0
        t_end = L
    else:
        t_begin = tl.load(block_indices + i_b * 2 + 1).to(tl.int64) * BT
        t_end = tl.minimum(t_begin + BT, L)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, BW)
    m_w = o_w < W - 1
    # (the interpreter rejects scalar & block masks, hence the `o_d * 0 + scalar` vectors)
    slot0 = tl.load(initial_idx + i_n).to(tl.int64)
    m_init = m_w[:, None] & (m_d & (o_d * 0 + slot0 >= 0))[None, :]
    p_init = state_in + tl.maximum(slot0, 0) * stride_in_s + o_d[None, :] * stride_in_d + o_w[:, None]
    b_init = tl.load(p_init, mask=m_init, other=0.0).to(tl.float32)  # [BW, BD]
    # the initial slot may also be an output slot: read it completely before any store
    tl.debug_barrier()

    for t0 in range(t_begin, t_end, BT):
        o_r = t0 + tl.arange(0, BT)
        b_y = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(W):
            b_w = tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
            b_y += b_w[None, :] * _conv_inputs(x, b_init, bos, L, o_r - (W - 1) + j, o_d, m_d, D, W - 1, BW)
        b_y = b_y * tl.sigmoid(b_y)
        p_y = y + (bos + o_r).to(tl.int64)[:, None] * D + o_d[None, :]
        tl.store(p_y, b_y.to(y.dtype.element_ty), mask=(o_r < t_end)[:, None] & m_d[None, :])

    if STORE_EVERY_TOKEN:
        for t in range(t_begin, t_end):
            slot = tl.load(out_idx + i_n * stride_out_idx + t).to(tl.int64)
            b_win = _conv_inputs(x, b_init, bos, L, t - (W - 2) + o_w, o_d, m_d, D, W - 1, BW)
            p_out = state_out + tl.maximum(slot, 0) * stride_out_s + o_d[None, :] * stride_out_d + o_w[:, None]
            m_out = m_w[:, None] & (m_d & (o_d * 0 + slot >= 0))[None, :]
            tl.store(p_out, b_win.to(state_out.dtype.element_ty), mask=m_out)
    else:
        # only the program holding the last token writes the sequence's final window
        slot = tl.load(out_idx + i_n).to(tl.int64)
        b_win = _conv_inputs(x, b_init, bos, L, L - 1 - (W - 2) + o_w, o_d, m_d, D, W - 1, BW)
        p_out = state_out + tl.maximum(slot, 0) * stride_out_s + o_d[None, :] * stride_out_d + o_w[:, None]
        m_out = m_w[:, None] & (m_d & (o_d * 0 + slot >= 0) & (o_d * 0 + t_end == L))[None, :]
        tl.store(p_out, b_win.to(state_out.dtype.element_ty), mask=m_out)


def _launch(x, weight, y, cu, state_in, initial_idx, state_out, out_idx, whole_seq: bool, store_every_token: bool):
    D, W = weight.shape
    assert W >= 2, f"conv width must be >= 2, got {W}"
    assert state_in.stride(-1) == 1 and state_out.stride(-1) == 1, "conv states must be contiguous in the window dim"
    if whole_seq:  # decode / verification: a few tokens a sequence (out_idx [N, tokens]), wider channel blocks
        N = cu.numel() - 1
        seqs = torch.arange(N, device=x.device)
        block_indices = torch.stack([seqs, torch.zeros_like(seqs)], 1)  # one program per sequence
        BT = min(PREFILL_BT, triton.next_power_of_2(out_idx.shape[1] if out_idx.dim() == 2 else 1))
    else:
        BT = PREFILL_BT
        block_indices = chunk_layout(cu, BT).chunk_indices
    BD = min(max(128, TILE // BT) if whole_seq else 128, triton.next_power_of_2(D))
    grid = (triton.cdiv(D, BD), block_indices.shape[0])
    if grid[1] == 0:
        return
    causal_conv1d_fwd_kernel[grid](
        x, weight, y, state_in, initial_idx, state_out, out_idx, cu, block_indices.contiguous(),
        state_in.stride(0), state_in.stride(1), state_out.stride(0), state_out.stride(1),
        out_idx.stride(0) if out_idx.dim() == 2 else 1, D,
        W=W, BW=triton.next_power_of_2(W - 1), BT=BT, BD=BD,
        WHOLE_SEQ=whole_seq, STORE_EVERY_TOKEN=store_every_token,
    )


def causal_conv1d_triton(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill -> (y [T, D], final_state [N, D, W - 1]), both in x's dtype."""
    x, weight = x.contiguous(), weight.contiguous()
    D, W = weight.shape
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    N = cu.numel() - 1
    y = torch.empty_like(x)
    final = torch.empty(N, D, W - 1, dtype=x.dtype, device=x.device)
    seqs = torch.arange(N, device=x.device)
    if initial_state is None:
        state_in, initial_idx = final, torch.full_like(seqs, -1)
    else:
        state_in, initial_idx = initial_state.contiguous(), seqs
    _launch(x, weight, y, cu, state_in, initial_idx, final, seqs, whole_seq=False, store_every_token=False)
    empty = (cu[1:] == cu[:-1]).nonzero()[:, 0]  # sequences without tokens keep their window
    if empty.numel():
        final[empty] = 0 if initial_state is None else initial_state[empty].to(x.dtype)
    return y, final


def causal_conv1d_spec_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Per-token windows into state_pool [S, D, W - 1] (see causal_conv1d_cpu.causal_conv1d_spec_cpu) -> y."""
    x, weight = x.contiguous(), weight.contiguous()
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    y = torch.empty_like(x)
    _launch(
        x, weight, y, cu, state_pool, initial_slots.long().contiguous(), state_pool, out_slots.long().contiguous(),
        whole_seq=True, store_every_token=True,
    )
    return y
