"""Reference causal depthwise conv1d (KDA's short conv) over packed sequences, with SiLU.

x [T, D] packs sequences by cu_seqlens [N + 1]; weight [D, W]; conv state [N, D, W - 1] holds
the last W - 1 inputs of each sequence (zeros at a sequence start).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    D, W = weight.shape
    N = cu_seqlens.numel() - 1
    y = torch.empty_like(x)
    final = x.new_empty(N, D, W - 1)
    w = weight.float()
    for i in range(N):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        prev = x.new_zeros(W - 1, D) if initial_state is None else initial_state[i].T.to(x.dtype)
        xs = torch.cat([prev, x[s:e]], 0).float()  # [W - 1 + L, D]
        L = e - s
        out = sum(w[:, j] * xs[j : j + L] for j in range(W))
        if activation == "silu":
            out = F.silu(out)
        y[s:e] = out.to(x.dtype)
        final[i] = xs[-(W - 1) :].T.to(x.dtype) if W > 1 else final[i]
    return y, final


def naive_causal_conv1d_spec(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Speculative verification with SiLU: sequence i starts from the window in
    state_pool[initial_slots[i]] (zeros if < 0) and leaves the window after its token j in
    state_pool[out_slots[i, j]] (skipped if < 0). All initial windows are read first -> y [T, D]."""
    D, W = weight.shape
    starts = [
        state_pool[int(s)].clone() if int(s) >= 0 else state_pool.new_zeros(D, W - 1) for s in initial_slots
    ]
    y = torch.empty_like(x)
    one = torch.tensor([0, 1])
    for i in range(cu_seqlens.numel() - 1):
        window = starts[i][None]
        for t in range(int(cu_seqlens[i]), int(cu_seqlens[i + 1])):
            y[t : t + 1], window = naive_causal_conv1d(x[t : t + 1], weight, one, window)
            slot = int(out_slots[i, t - int(cu_seqlens[i])])
            if slot >= 0:
                state_pool[slot] = window[0].to(state_pool.dtype)
    return y
