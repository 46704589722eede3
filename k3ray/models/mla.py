"""Gated NoPE MLA layer (24 of K3's 93 layers): q-LoRA, a 576-wide latent cache per token
(normalised c_kv 512 + unrotated shared k_r 64), and a sigmoid output gate on the layer input.

Two attention forms over the same cache: `naive` (expand K/V with kv_b_proj, used for prefill)
and `absorbed` (fold W_UK into q and W_UV after attention, MQA over the latent; decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k3ray.config import MLA_NORM_EPS
from k3ray.device import to_device
from k3ray.kernels.mla import mla_decode, mla_prefill, mla_prefill_paged
from k3ray.kernels.mla.naive import absorbed_mla_attention, naive_mla_attention
from k3ray.models.forward_batch import ForwardBatch
from k3ray.models.norm import RMSNorm

# a sequence whose expanded prefill scores (new tokens x context x heads) would exceed this many
# elements attends in the absorbed, key-chunked form instead: bounded memory at 1M-token contexts
EXPANDED_PREFILL_MAX_SCORES = 1 << 26


class GatedMLA(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        use_output_gate: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.kv_lora_rank, self.nope, self.rope, self.v_dim = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=dtype)  # noqa: E731
        self.q_a_proj = lin(hidden_size, q_lora_rank)
        self.q_a_layernorm = RMSNorm(q_lora_rank, MLA_NORM_EPS, dtype)
        self.q_b_proj = lin(q_lora_rank, num_heads * (qk_nope_head_dim + qk_rope_head_dim))
        self.kv_a_proj_with_mqa = lin(hidden_size, kv_lora_rank + qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, MLA_NORM_EPS, dtype)
        self.kv_b_proj = lin(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.g_proj = lin(hidden_size, num_heads * v_head_dim) if use_output_gate else None
        self.o_proj = lin(num_heads * v_head_dim, hidden_size)

    # pieces -------------------------------------------------------------------------------
    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """[T, D] -> q [T, H, nope + rope]."""
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(x.shape[0], self.num_heads, -1)

    def project_latent(self, x: torch.Tensor) -> torch.Tensor:
        """[T, D] -> the cached latent [T, kv_lora_rank + rope]."""
        c_kv, k_r = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        return torch.cat([self.kv_a_layernorm(c_kv), k_r], -1)

    def _w_kvb(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, L], W_UV [H, v, L]

    def expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [Tk, L + R] -> k [Tk, H, nope + rope], v [Tk, H, v]."""
        kv = self.kv_b_proj(latent[:, : self.kv_lora_rank]).view(latent.shape[0], self.num_heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k_r = latent[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        return torch.cat([k_nope, k_r], -1), v

    def absorb_q(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, nope + rope] -> [T, H, L + rope] (W_UK folded into q)."""
        w_uk, _ = self._w_kvb()
        q_nope, q_r = q.split([self.nope, self.rope], -1)
        return torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_r], -1)

    def unabsorb_o(self, o_latent: torch.Tensor) -> torch.Tensor:
        """[T, H, L] -> [T, H, v] (W_UV applied after attention)."""
        _, w_uv = self._w_kvb()
        return torch.einsum("thl,hvl->thv", o_latent, w_uv)

    def attend_naive(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """One sequence: q [Tq, H, Dqk] are the last Tq positions of latent [Tk, L + R]."""
        k, v = self.expand_kv(latent)
        return naive_mla_attention(q, k, v, self.scale)

    def attend_absorbed(self, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        o_lat = absorbed_mla_attention(self.absorb_q(q), latent, self.kv_lora_rank, self.scale)
        return self.unabsorb_o(o_lat)

    def gate_and_project(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        o = o.reshape(x.shape[0], -1)
        if self.g_proj is not None:
            o = (o.float() * torch.sigmoid(self.g_proj(x).float())).to(x.dtype)
        return self.o_proj(o.to(x.dtype))

    def _prefill_expanded(self, q, o, cache, plan: ExpandedPrefill, dtype) -> None:
        """Naive form for the plan's sequences: expand their cached latents to K / V, then one
        packed causal attention call."""
        k, v = self.expand_kv(cache[plan.latent_slots].to(dtype))
        if plan.rows is None:
            o[:] = mla_prefill(q, k, v, plan.cu_q, plan.cu_k, self.scale)
        else:
            o[plan.rows] = mla_prefill(q[plan.rows], k, v, plan.cu_q, plan.cu_k, self.scale)

    # step ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cache = batch.cache.mla_latent[self.layer_idx]
        q = self.project_q(x)
        latent = self.project_latent(x)
        cache[batch.slot_mapping] = (latent if batch.latent_rows is None else latent[batch.latent_rows]).to(cache.dtype)
        split = batch.decode_split()
        if batch.is_decode:
            o = self._decode(q, cache, batch, x.dtype)
        elif split is not None:  # a mixed step: decodes on the decode kernel, the rest as prefill
            o = torch.empty(x.shape[0], self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
            o[split.decode_rows] = self._decode(q[split.decode_rows], cache, split.decode, x.dtype)
            o[split.prefill_rows] = self._prefill(q[split.prefill_rows], cache, split.prefill, x.dtype)
        else:
            o = self._prefill(q, cache, batch, x.dtype)
        return self.gate_and_project(x, o)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, dtype) -> torch.Tensor:
        """One query token per sequence, each after a cached prefix (absorbed form)."""
        o_lat = mla_decode(self.absorb_q(q), cache, batch.block_tables, batch.context_lens,
                           batch.cache.block_size, self.kv_lora_rank, self.scale)
        return self.unabsorb_o(o_lat.to(dtype))

    def _prefill(self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, dtype) -> torch.Tensor:
        """Each sequence: absorbed paged attention when its score matrix is large, else expanded."""
        o = torch.empty(q.shape[0], self.num_heads, self.v_dim, dtype=dtype, device=q.device)
        paged, expanded = batch.derived(("mla_prefill", self.num_heads),
                                        lambda: plan_prefill(batch, self.num_heads))
        for i, s, e, prior in paged:
            o_lat = mla_prefill_paged(
                self.absorb_q(q[s:e]), cache, batch.block_tables[i], prior,
                batch.cache.block_size, self.kv_lora_rank, self.scale,
            )
            o[s:e] = self.unabsorb_o(o_lat.to(dtype))
        if expanded is not None:
            self._prefill_expanded(q, o, cache, expanded, dtype)
        return o


@dataclass(frozen=True)
class ExpandedPrefill:
    """The sequences of a prefill batch that attend in the expanded form, as one packed call."""

    rows: torch.Tensor | None  # [Tq] their token rows (None: every row of the batch, in order)
    latent_slots: torch.Tensor  # [Tk] cache rows of their contexts, sequence after sequence
    cu_q: torch.Tensor  # [n + 1] host offsets of their queries
    cu_k: torch.Tensor  # [n + 1] host offsets of their contexts


def plan_prefill(batch: ForwardBatch, num_heads: int) -> tuple[list[tuple[int, int, int, int]], ExpandedPrefill | None]:
    """Which sequences take the paged absorbed form ((seq, first row, end row, prior len) each) and
    the expanded plan of the rest; worked out on the host once per batch, shared by every MLA layer."""
    cu, ctx = batch.host_cu_seqlens, batch.host_context_lens
    tables = batch.host_block_tables
    bs = batch.cache.block_size
    paged, rows, slots, cu_q, cu_k = [], [], [], [0], [0]
    for i in range(batch.num_seqs):
        s, e = cu[i], cu[i + 1]
        if (e - s) * ctx[i] * num_heads > EXPANDED_PREFILL_MAX_SCORES:
            paged.append((i, s, e, ctx[i] - (e - s)))
            continue
        pos = torch.arange(ctx[i])
        rows.append(torch.arange(s, e))
        slots.append(tables[i, pos // bs] * bs + pos % bs)
        cu_q.append(cu_q[-1] + e - s)
        cu_k.append(cu_k[-1] + ctx[i])
    if not rows:
        return paged, None
    all_rows = not paged
    moved = to_device([torch.cat(rows), torch.cat(slots)], batch.cache.device)
    return paged, ExpandedPrefill(None if all_rows else moved[0], moved[1], torch.tensor(cu_q), torch.tensor(cu_k))
