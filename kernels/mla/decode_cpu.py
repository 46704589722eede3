"""Vectorised CPU absorbed MLA decode: the latents of all sequences are gathered chunk by chunk
along the context and merged with an online softmax, so memory stays bounded at long contexts."""

from __future__ import annotations

import torch

from k3ray.kernels.mla.online_softmax import DECODE_CHUNK_ELEMENTS, OnlineSoftmax, accumulation_dtype


def mla_decode_cpu(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """q_latent [N, H, L + R] over the paged cache [slots, L + R] -> [N, H, L] (q's dtype)."""
    N, H, D = q_latent.shape
    L = kv_lora_rank
    lens = context_lens.long()
    max_len = int(lens.max()) if N else 0
    chunk = chunk or max(block_size, DECODE_CHUNK_ELEMENTS // max(N * D, 1))
    dtype = accumulation_dtype(q_latent, cache)
    qf = q_latent.to(dtype) * scale  # [N, H, D]
    softmax = OnlineSoftmax((N, H), L, dtype)
    tables = block_tables.long()
    for c0 in range(0, max_len, chunk):
        pos = torch.arange(c0, min(c0 + chunk, max_len))  # [C]
        valid = pos[None, :] < lens[:, None]  # [N, C]
        slots = tables[:, pos // block_size] * block_size + pos % block_size
        lat = cache[torch.where(valid, slots, 0)].to(dtype)  # [N, C, D]
        s = torch.bmm(qf, lat.transpose(1, 2)).masked_fill_(~valid[:, None, :], float("-inf"))  # [N, H, C]
        softmax.add(s, lat[..., :L])
    return softmax.result().to(q_latent.dtype)
