"""MLA attention entry points (NoPE, one shared latent KV head of width L + R): Triton on CUDA
tensors, the vectorised PyTorch paths on CPU tensors (`*_triton.py`, `*_cpu.py`). The
references are in naive.py."""

from __future__ import annotations

import torch

from k3ray.kernels.mla.decode_cpu import mla_decode_cpu
from k3ray.kernels.mla.decode_triton import mla_decode_triton
from k3ray.kernels.mla.prefill_cpu import mla_prefill_cpu
from k3ray.kernels.mla.prefill_paged_chunked import mla_prefill_paged_chunked
from k3ray.kernels.mla.prefill_paged_cpu import mla_prefill_paged_cpu
from k3ray.kernels.mla.prefill_triton import mla_prefill_triton


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
    if q.dim() != 3 or k.shape[1:] != q.shape[1:] or v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"expected q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv]; got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both be [N + 1]; got {list(cu_seqlens_q.shape)} "
            f"and {list(cu_seqlens_k.shape)}"
        )
    if q.is_cuda:
        return mla_prefill_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return mla_prefill_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, scale)


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
    if q_latent.dim() != 3 or cache.dim() != 2 or cache.shape[-1] != q_latent.shape[-1]:
        raise ValueError(
            f"expected q_latent [N, H, L + R] and cache [slots, L + R]; got {list(q_latent.shape)} "
            f"and {list(cache.shape)}"
        )
    if not 0 < kv_lora_rank <= q_latent.shape[-1]:
        raise ValueError(f"kv_lora_rank must be in (0, {q_latent.shape[-1]}], got {kv_lora_rank}")
    N = q_latent.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != N or context_lens.shape != (N,):
        raise ValueError(
            f"expected block_tables [{N}, B] and context_lens [{N}]; got {list(block_tables.shape)} "
            f"and {list(context_lens.shape)}"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if q_latent.is_cuda:
        return mla_decode_triton(q_latent, cache, block_tables, context_lens, block_size, kv_lora_rank, scale)
    return mla_decode_cpu(q_latent, cache, block_tables, context_lens, block_size, kv_lora_rank, scale)


def mla_prefill_paged(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prior_len: int,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """Long-context prefill of one sequence in the absorbed form, straight from the paged cache
    with bounded memory: q_latent [Tq, H, L + R] (the last Tq of prior_len + Tq positions) ->
    [Tq, H, L]. CPU tensors take ATen's CPU flash attention; others the key-chunked PyTorch path."""
    if q_latent.dim() != 3 or cache.dim() != 2 or cache.shape[-1] != q_latent.shape[-1]:
        raise ValueError(
            f"expected q_latent [Tq, H, L + R] and cache [slots, L + R]; got {list(q_latent.shape)} "
            f"and {list(cache.shape)}"
        )
    if prior_len < 0:
        raise ValueError(f"prior_len must be >= 0, got {prior_len}")
    if q_latent.device.type == "cpu":
        return mla_prefill_paged_cpu(q_latent, cache, block_table, prior_len, block_size, kv_lora_rank, scale)
    return mla_prefill_paged_chunked(q_latent, cache, block_table, prior_len, block_size, kv_lora_rank, scale)
