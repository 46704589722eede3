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
