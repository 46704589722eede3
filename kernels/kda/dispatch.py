"""The KDA entry points the model calls. Packed layout (no batch dim): q, k, g [T, H, K];
v [T, H, V]; beta [T, H]; states [N, H, K, V] fp32; cu_seqlens [N + 1] int."""

from __future__ import annotations

import torch

from k3ray.kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill over packed sequences -> (o [T, H, V] in v's dtype, final_state [N, H, K, V] fp32)."""
    o = torch.empty_like(v)
    final = torch.empty_like(initial_state, dtype=torch.float32)
    for i in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        o_i, S_i = naive_chunk_kda(
            q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
            scale=scale, initial_state=initial_state[i : i + 1], output_final_state=True,
        )
        o[s:e] = o_i[0].to(v.dtype)
        final[i] = S_i[0]
    return o, final


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
    in place -> o [N, H, V]."""
    S = state_pool[state_indices.long()]
    o, S = naive_recurrent_kda(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
        scale=scale, initial_state=S, output_final_state=True,
    )
    state_pool[state_indices.long()] = S.to(state_pool.dtype)
    return o[:, 0].to(v.dtype)
