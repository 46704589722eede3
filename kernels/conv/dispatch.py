"""Short-conv entry points: x [T, D] packed by cu_seqlens; weight [D, W]; states [*, D, W - 1]."""

from __future__ import annotations

import torch

from k3ray.kernels.conv.naive import naive_causal_conv1d


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill with SiLU -> (y [T, D], final_state [N, D, W - 1])."""
    return naive_causal_conv1d(x, weight, cu_seqlens, initial_state)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor, state_indices: torch.Tensor
) -> torch.Tensor:
    """One token per sequence (x [N, D]); rolls state_pool[state_indices] in place -> y [N, D]."""
    idx = state_indices.long()
    cu = torch.arange(x.shape[0] + 1, device=x.device)
    y, final = naive_causal_conv1d(x, weight, cu, state_pool[idx])
    state_pool[idx] = final.to(state_pool.dtype)
    return y
