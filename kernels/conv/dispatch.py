"""Short-conv entry points: x [T, D] packed by cu_seqlens; weight [D, W]; states [*, D, W - 1].
CUDA tensors run the Triton kernel, CPU tensors the vectorised PyTorch path; both apply SiLU."""

from __future__ import annotations

import torch

from k3ray.kernels.conv.causal_conv1d_cpu import causal_conv1d_cpu, causal_conv1d_spec_cpu
from k3ray.kernels.conv.causal_conv1d_triton import causal_conv1d_spec_triton, causal_conv1d_triton
from k3ray.kernels.kda.varlen import check_cu_seqlens, check_spec_slots


def _check(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, state_name: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"x must be [T, D] and weight [D, W], got {list(x.shape)} and {list(weight.shape)}")
    if weight.shape[1] < 2:
        raise ValueError(f"conv width must be at least 2, got weight {list(weight.shape)}")
    if state is not None and list(state.shape[1:]) != [x.shape[1], weight.shape[1] - 1]:
        raise ValueError(
            f"{state_name} must be [*, {x.shape[1]}, {weight.shape[1] - 1}], got {list(state.shape)}"
        )


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill with SiLU -> (y [T, D], final_state [N, D, W - 1]), both in x's dtype.
    initial_state [N, D, W - 1] holds each sequence's last W - 1 inputs (None: zeros)."""
    _check(x, weight, initial_state, "initial_state")
    check_cu_seqlens(cu_seqlens, x.shape[0])
    if x.is_cuda:
        return causal_conv1d_triton(x, weight, cu_seqlens, initial_state)
    return causal_conv1d_cpu(x, weight, cu_seqlens, initial_state)


def causal_conv1d_spec(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Speculative verification with SiLU -> y [T, D]. Sequence i starts from the window in
    state_pool[initial_slots[i]] (zeros if < 0) and leaves the window after its token j in
    state_pool[out_slots[i, j]] (skipped if < 0). No out slot may be another sequence's initial slot."""
    _check(x, weight, state_pool, "state_pool")
    check_spec_slots(cu_seqlens, x.shape[0], initial_slots, out_slots)
    if x.is_cuda:
        return causal_conv1d_spec_triton(x, weight, cu_seqlens, state_pool, initial_slots, out_slots)
    return causal_conv1d_spec_cpu(x, weight, cu_seqlens, state_pool, initial_slots, out_slots)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor, state_indices: torch.Tensor
) -> torch.Tensor:
    """One token per sequence (x [N, D]); rolls state_pool[state_indices] in place -> y [N, D]."""
    N = x.shape[0]
    if state_indices.shape != (N,):
        raise ValueError(f"state_indices must be [{N}], got {list(state_indices.shape)}")
    _check(x, weight, state_pool, "state_pool")
    cu = torch.arange(N + 1, device=x.device)
    impl = causal_conv1d_spec_triton if x.is_cuda else causal_conv1d_spec_cpu
    return impl(x, weight, cu, state_pool, state_indices, state_indices[:, None])
