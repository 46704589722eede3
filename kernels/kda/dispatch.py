"""The KDA entry points the model calls. Packed layout (no batch dim): q, k, g [T, H, K];
v [T, H, V]; beta [T, H]; states [N, H, K, V] fp32 (K-first); cu_seqlens [N + 1] int.
q and k are L2-normalised by the caller; scale multiplies q inside.
CUDA tensors run the Triton kernels, CPU tensors the vectorised PyTorch paths."""

from __future__ import annotations

import torch

from k3ray.kernels.kda.chunk_cpu import chunk_kda_cpu
from k3ray.kernels.kda.chunk_triton import chunk_kda_triton
from k3ray.kernels.kda.fused_recurrent_cpu import fused_recurrent_kda_cpu
from k3ray.kernels.kda.fused_recurrent_triton import fused_recurrent_kda_triton
from k3ray.kernels.kda.varlen import check_cu_seqlens, check_spec_slots


def _check_inputs(q, k, v, g, beta) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, K], got {list(q.shape)}")
    T, H, K = q.shape
    for name, x, want in (("k", k, [T, H, K]), ("g", g, [T, H, K]), ("beta", beta, [T, H])):
        if list(x.shape) != want:
            raise ValueError(f"{name} must be {want} like q, got {list(x.shape)}")
    if v.dim() != 3 or list(v.shape[:2]) != [T, H]:
        raise ValueError(f"v must be [{T}, {H}, V], got {list(v.shape)}")


def _check_pool(state_pool: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    want = [q.shape[1], q.shape[2], v.shape[2]]
    if state_pool.dim() != 4 or list(state_pool.shape[1:]) != want or state_pool.dtype != torch.float32:
        raise ValueError(f"state_pool must be fp32 [S, {want[0]}, {want[1]}, {want[2]}], got "
                         f"{state_pool.dtype} {list(state_pool.shape)}")


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill over packed sequences (chunk 64, WY/UT form) -> (o [T, H, V] in v's dtype,
    final_state [N, H, K, V] fp32). initial_state [N, H, K, V] (None: zeros)."""
    _check_inputs(q, k, v, g, beta)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    N = cu_seqlens.numel() - 1
    want = [N, q.shape[1], q.shape[2], v.shape[2]]
    if initial_state is not None and list(initial_state.shape) != want:
        raise ValueError(f"initial_state must be {want}, got {list(initial_state.shape)}")
    impl = chunk_kda_triton if q.is_cuda else chunk_kda_cpu
    return impl(q, k, v, g, beta, scale, initial_state, cu_seqlens)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One decode token per sequence (q [N, H, K]); reads and writes state_pool[state_indices]
    in place (an index < 0 starts from zeros and stores nothing) -> o [N, H, V]."""
    _check_inputs(q, k, v, g, beta)
    _check_pool(state_pool, q, v)
    N = q.shape[0]
    if state_indices.shape != (N,):
        raise ValueError(f"state_indices must be [{N}], got {list(state_indices.shape)}")
    cu = torch.arange(N + 1, device=q.device)
    impl = fused_recurrent_kda_triton if q.is_cuda else fused_recurrent_kda_cpu
    return impl(q, k, v, g, beta, scale, state_pool, state_indices, cu, state_indices[:, None])


def fused_recurrent_kda_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Speculative verification -> o [T, H, V]. Sequence i starts from state_pool[initial_slots[i]]
    (zeros if < 0) and leaves the state after its token j in state_pool[out_slots[i, j]]
    (skipped if < 0), so rolling back a rejected draft is choosing a slot. No out slot may be
    another sequence's initial slot."""
    _check_inputs(q, k, v, g, beta)
    _check_pool(state_pool, q, v)
    check_spec_slots(cu_seqlens, q.shape[0], initial_slots, out_slots)
    impl = fused_recurrent_kda_triton if q.is_cuda else fused_recurrent_kda_cpu
    return impl(q, k, v, g, beta, scale, state_pool, initial_slots, cu_seqlens, out_slots)
