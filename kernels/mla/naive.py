"""Reference NoPE MLA attention: the naive (expanded K/V) form and the weight-absorbed form
over the 576-wide latent (kv_lora_rank normalised c_kv + the shared unrotated k_r).

Queries are the last Tq positions of a context of Tk keys (Tk >= Tq): query i sits at absolute
position Tk - Tq + i and sees keys 0..Tk - Tq + i.
"""

from __future__ import annotations

import torch


def _acc(*ts: torch.Tensor) -> list[torch.Tensor]:
    """fp32 math for fp32 / bf16 / fp16 inputs; float64 inputs keep float64."""
    dtype = torch.float32
    for t in ts:
        dtype = torch.promote_types(dtype, t.dtype)
    return [t.to(dtype) for t in ts]


def _causal_mask(Tq: int, Tk: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(Tk - Tq, Tk, device=device)[:, None]
    return torch.arange(Tk, device=device)[None, :] <= q_pos  # [Tq, Tk]


def naive_mla_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> o [Tq, H, Dv]; softmax in fp32 (fp64 for fp64)."""
    q32, k32, v32 = _acc(q, k, v)
    s = torch.einsum("qhd,khd->hqk", q32, k32) * scale
    s = s.masked_fill(~_causal_mask(q.shape[0], k.shape[0], q.device), float("-inf"))
    p = s.softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v32).to(q.dtype)


def absorbed_mla_attention(
    q_latent: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int, scale: float
) -> torch.Tensor:
    """MQA over the latent: q_latent [Tq, H, L + R] (q_nope W_UK | q_r), latent [Tk, L + R]
    -> o_latent [Tq, H, L] (values are the first L latent dims; W_UV is applied by the caller)."""
    q32, lat32 = _acc(q_latent, latent)
    s = torch.einsum("qhd,kd->hqk", q32, lat32) * scale
    s = s.masked_fill(~_causal_mask(q_latent.shape[0], latent.shape[0], latent.device), float("-inf"))
    p = s.softmax(-1)
    return torch.einsum("hqk,kd->qhd", p, lat32[:, :kv_lora_rank]).to(q_latent.dtype)


def gather_latent(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, block_size: int
) -> torch.Tensor:
    """The first `length` latent rows of one sequence from a paged cache [num_slots, L + R]."""
    pos = torch.arange(length, device=cache.device)
    slots = block_table[pos // block_size].long() * block_size + pos % block_size
    return cache[slots]


def naive_paged_mla_decode(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """One query per sequence: q_latent [N, H, L + R] over paged latents -> [N, H, L]."""
    out = q_latent.new_empty(q_latent.shape[0], q_latent.shape[1], kv_lora_rank)
    for i in range(q_latent.shape[0]):
        lat = gather_latent(cache, block_tables[i], int(context_lens[i]), block_size)
        out[i] = absorbed_mla_attention(q_latent[i : i + 1], lat, kv_lora_rank, scale)[0]
    return out
