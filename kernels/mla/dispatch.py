"""MLA attention entry points (NoPE, one shared latent KV head of width L + R)."""

from __future__ import annotations

import torch

from k3ray.kernels.mla.naive import naive_mla_attention, naive_paged_mla_decode


def mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention per sequence on expanded K/V: q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]
    packed; each sequence's queries are the last positions of its keys -> o [Tq, H, Dv]."""
    o = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        o[qs:qe] = naive_mla_attention(q[qs:qe], k[ks:ke], v[ks:ke], scale)
    return o


def mla_decode(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed decode: q_latent [N, H, L + R] over the paged cache [slots, L + R] -> [N, H, L]."""
    return naive_paged_mla_decode(q_latent, cache, block_tables, context_lens, block_size, kv_lora_rank, scale)
