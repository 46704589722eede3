"""MLA long-context prefill of one sequence in plain PyTorch, key-chunked with an online softmax:
the path `mla_prefill_paged` takes for tensors on any device but the CPU (which has a faster one
in prefill_paged_cpu.py)."""

from __future__ import annotations

import torch

from k3ray.kernels.mla.online_softmax import DECODE_CHUNK_ELEMENTS, OnlineSoftmax, accumulation_dtype


def mla_prefill_paged_chunked(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prior_len: int,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """One sequence's new queries (absorbed) over its paged latents, causal, key-chunked with an
    online softmax so memory is O(Tq * chunk), not O(Tq * context): q_latent [Tq, H, L + R] at
    positions prior_len .. prior_len + Tq - 1 -> [Tq, H, L] (q's dtype). Plain PyTorch, so it
    serves any device; on CPU tensors `mla_prefill_paged_cpu` is the fast path."""
    Tq, H, D = q_latent.shape
    L = kv_lora_rank
    total = prior_len + Tq
    chunk = chunk or max(block_size, DECODE_CHUNK_ELEMENTS // max(Tq * H, 1))
    dtype = accumulation_dtype(q_latent, cache)
    qf = (q_latent.to(dtype) * scale).reshape(Tq * H, D)  # [Tq * H, D]
    device = cache.device
    q_pos = (prior_len + torch.arange(Tq, device=device)).repeat_interleave(H)[:, None]  # [Tq * H, 1]
    softmax = OnlineSoftmax((Tq * H,), L, dtype, device)
    table = block_table.to(device).long()
    for c0 in range(0, total, chunk):
        pos = torch.arange(c0, min(c0 + chunk, total), device=device)  # [C]
        lat = cache[table[pos // block_size] * block_size + pos % block_size].to(dtype)  # [C, D]
        s = (qf @ lat.T).masked_fill_(pos[None, :] > q_pos, float("-inf"))  # [Tq * H, C]
        softmax.add(s, lat[:, :L])
    return softmax.result().view(Tq, H, L).to(q_latent.dtype)
