"""Kimi Delta Attention layer (69 of K3's 93 layers): short conv, safe gate, delta rule."""

from __future__ import annotations

import torch
from torch import nn

from k3ray.config import L2_NORM_EPS
from k3ray.kernels.conv import causal_conv1d, causal_conv1d_spec, causal_conv1d_update
from k3ray.kernels.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_spec, kda_gate, l2norm
from k3ray.models.forward_batch import ForwardBatch
from k3ray.models.norm import gated_rms_norm


class KimiDeltaAttention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        a_log_size: int,
        conv_size: int,
        gate_lower_bound: float,
        norm_eps: float,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = num_heads, head_dim
        self.gate_lower_bound = gate_lower_bound
        self.norm_eps = norm_eps
        D = num_heads * head_dim
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=dtype)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(hidden_size, D), lin(hidden_size, D), lin(hidden_size, D)
        self.q_conv1d = nn.Conv1d(D, D, conv_size, groups=D, bias=False, dtype=torch.float32)
        self.k_conv1d = nn.Conv1d(D, D, conv_size, groups=D, bias=False, dtype=torch.float32)
        self.v_conv1d = nn.Conv1d(D, D, conv_size, groups=D, bias=False, dtype=torch.float32)
        self.f_a_proj = lin(hidden_size, head_dim)
        self.f_b_proj = lin(head_dim, D)
        self.dt_bias = nn.Parameter(torch.zeros(D, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(a_log_size, dtype=torch.float32))
        self.b_proj = lin(hidden_size, num_heads)
        self.g_proj = lin(hidden_size, D)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(head_dim, dtype=torch.float32))
        self.o_proj = lin(D, hidden_size)

    def conv_weight(self) -> torch.Tensor:
        """[3 * D, W]: the q | k | v depthwise filters as one conv over concatenated channels."""
        return torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], 0)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        H, K = self.num_heads, self.head_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)  # [T, 3 * H * K]
        conv_pool = batch.cache.conv_state[self.layer_idx]
        state_pool = batch.cache.kda_state[self.layer_idx]
        slots = batch.state_slots.long()
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(T, H, K), self.A_log, self.dt_bias, self.gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, H]
        split = batch.decode_split()
        if batch.is_decode and batch.spec_state_slots is None:
            o = self._decode(qkv, g, beta, conv_pool, state_pool, slots)
        elif batch.spec_state_slots is not None:
            o = self._prefill_per_token_states(qkv, g, beta, batch, conv_pool, state_pool)
        elif split is not None:  # a mixed step: decodes on the recurrent kernel, the rest chunked
            rows, part = split.decode_rows, split.decode
            o_decode = self._decode(qkv[rows], g[rows], beta[rows], conv_pool, state_pool, part.state_slots.long())
            rows, part = split.prefill_rows, split.prefill
            o_prefill = self._prefill(qkv[rows], g[rows], beta[rows], part, conv_pool, state_pool,
                                      part.state_slots.long())
            o = o_decode.new_empty(T, H, K)
            o[split.decode_rows] = o_decode
            o[split.prefill_rows] = o_prefill.to(o.dtype)
        else:
            o = self._prefill(qkv, g, beta, batch, conv_pool, state_pool, slots)
        o = gated_rms_norm(o, self.o_norm.weight, self.g_proj(x).view(T, H, K), self.norm_eps)
        return self.o_proj(o.reshape(T, H * K).to(x.dtype))

    def _decode(self, qkv, g, beta, conv_pool, state_pool, slots) -> torch.Tensor:
        """One new token per sequence, each after a cached prefix."""
        T = qkv.shape[0]
        H, K = self.num_heads, self.head_dim
        qkv = causal_conv1d_update(qkv, self.conv_weight(), conv_pool, slots)
        q, k, v = (t.reshape(T, H, K) for t in qkv.split(H * K, -1))
        q, k = l2norm(q, L2_NORM_EPS), l2norm(k, L2_NORM_EPS)
        return fused_recurrent_kda(q, k, v, g, beta, K**-0.5, state_pool, slots)

    def _prefill(self, qkv, g, beta, batch, conv_pool, state_pool, slots) -> torch.Tensor:
        T = qkv.shape[0]
        H, K = self.num_heads, self.head_dim
        has_prior = (batch.prior_lens > 0)[:, None, None]
        conv0 = torch.where(has_prior, conv_pool[slots], 0.0)
        state0 = torch.where(has_prior[..., None], state_pool[slots], 0.0)
        qkv, conv_final = causal_conv1d(qkv, self.conv_weight(), batch.cu_seqlens, conv0)
        q, k, v = (t.reshape(T, H, K) for t in qkv.split(H * K, -1))
        q, k = l2norm(q, L2_NORM_EPS), l2norm(k, L2_NORM_EPS)
        o, final = chunk_kda(q, k, v, g, beta, K**-0.5, state0, batch.cu_seqlens)
        conv_pool[slots] = conv_final.to(conv_pool.dtype)
        state_pool[slots] = final
        return o

    def _prefill_per_token_states(self, qkv, g, beta, batch, conv_pool, state_pool) -> torch.Tensor:
        """Speculative verification: the state after new token j of sequence i goes to
        spec_state_slots[i, j], so keeping the first a accepted tokens is choosing slot a - 1.
        The kernels read the initial states from the pools themselves."""
        T = qkv.shape[0]
        H, K = self.num_heads, self.head_dim
        initial_slots = torch.where(batch.prior_lens > 0, batch.state_slots.long(), -1)  # -1: start from zeros
        out_slots = batch.spec_state_slots.long()
        qkv = causal_conv1d_spec(qkv, self.conv_weight(), batch.cu_seqlens, conv_pool, initial_slots, out_slots)
        q, k, v = (t.reshape(T, H, K) for t in qkv.split(H * K, -1))
        q, k = l2norm(q, L2_NORM_EPS), l2norm(k, L2_NORM_EPS)
        return fused_recurrent_kda_spec(
            q, k, v, g, beta, K**-0.5, state_pool, initial_slots, batch.cu_seqlens, out_slots
        )
