"""Causal depthwise conv1d + SiLU over packed sequences in plain PyTorch (the CPU fast path).

Each sequence's initial window is laid in front of its tokens in one extended buffer; a valid
conv over the whole buffer is W shifted row slices (no gathers), and every window after a token
is a row slice of that buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _extend(x: torch.Tensor, cu: torch.Tensor, init: torch.Tensor | None, W1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], init [N, D, W1] -> (ext [T + N * W1, D] fp32, base [T]): sequence i occupies rows
    cu[i] + i * W1 ... (its window, then its tokens); y[t] reads ext[base[t] : base[t] + W1 + 1]."""
    T, D = x.shape
    N = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), lens, output_size=T)
    base = torch.arange(T, device=x.device) + seq * W1
    ext = torch.empty(T + N * W1, D, dtype=torch.float32, device=x.device)
    init_rows = ((cu[:-1] + torch.arange(N, device=x.device) * W1)[:, None] + torch.arange(W1, device=x.device)).reshape(-1)
    if N == 1:
        ext[W1:].copy_(x)
    else:
        ext.index_copy_(0, base + W1, x.float())
    if init is None:
        ext[init_rows] = 0.0
    else:
        ext.index_copy_(0, init_rows, init.transpose(1, 2).reshape(N * W1, D).float())
    return ext, base


def _conv(ext: torch.Tensor, base: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU(valid depthwise conv) over the whole buffer, then the rows of real tokens -> [T, D]."""
    w = weight.float()
    W = w.shape[1]
    rows = ext.shape[0] - W + 1
    y = ext[:rows] * w[:, 0]
    for j in range(1, W):
        y.addcmul_(ext[j : j + rows], w[:, j])
    F.silu(y, inplace=True)
    return y if rows == base.numel() else y.index_select(0, base)  # one sequence: every row is a token


def _windows(ext: torch.Tensor, last_rows: torch.Tensor, W1: int) -> torch.Tensor:
    """The W1 rows ending at each of last_rows [M] -> [M, D, W1]."""
    rows = last_rows[:, None] - W1 + 1 + torch.arange(W1, device=ext.device)
    return ext[rows].transpose(1, 2)


def causal_conv1d_cpu(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: x [T, D]; weight [D, W]; initial_state [N, D, W - 1] or None (zeros)
    -> (y [T, D] in x's dtype, final_state [N, D, W - 1] in x's dtype)."""
    W1 = weight.shape[1] - 1
    cu = cu_seqlens.long().to(x.device)
    N = cu.numel() - 1
    ext, base = _extend(x, cu, initial_state, W1)
    y = _conv(ext, base, weight)
    seg_end = cu[1:] + torch.arange(1, N + 1, device=x.device) * W1  # one past each sequence's rows
    final = _windows(ext, seg_end - 1, W1)
    return y.to(x.dtype), final.to(x.dtype)


def causal_conv1d_spec_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Per-token windows into a pool: state_pool [S, D, W - 1]; initial_slots [N] (< 0: zeros);
    out_slots [N, Q] (< 0: not stored) -> y [T, D] in x's dtype."""
    W1 = weight.shape[1] - 1
    cu = cu_seqlens.long().to(x.device)
    init_slots = initial_slots.long()
    init = torch.zeros(init_slots.numel(), x.shape[1], W1, dtype=torch.float32, device=x.device)
    has_init = init_slots >= 0
    init[has_init] = state_pool[init_slots[has_init]].float()
    ext, base = _extend(x, cu, init, W1)
    y = _conv(ext, base, weight)
    T = x.shape[0]
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=x.device), cu[1:] - cu[:-1], output_size=T)
    slots = out_slots.long()[seq, torch.arange(T, device=x.device) - cu[:-1][seq]]  # [T]
    keep = slots >= 0
    state_pool[slots[keep]] = _windows(ext, base[keep] + W1, W1).to(state_pool.dtype)
    return y.to(x.dtype)
