"""The Kimi K3 text model: embedding, 93 hybrid decoder layers with Block Attention Residuals,
the output AttnRes, final norm and untied head. Pure math; caches arrive in a ForwardBatch.

A model may hold a layer range (a pipeline stage) and an expert range (its MoE layers hold only
those experts), or take its MoE layers' experts from a factory (experts held elsewhere);
`forward_layers` carries the AttnRes state (partial sum + bank) between stages.
"""

from __future__ import annotations

import torch
from torch import nn

from k3ray.config import ModelConfig
from k3ray.kernels.attn_res import attn_res_rmsnorm
from k3ray.models.forward_batch import ForwardBatch
from k3ray.models.kda import KimiDeltaAttention
from k3ray.models.mla import GatedMLA
from k3ray.models.moe import ExpertsFactory, LocalExperts, SituMLP, StableLatentMoE
from k3ray.models.norm import RMSNorm


def local_experts(config: ModelConfig, dtype: torch.dtype, expert_range: tuple[int, int]) -> ExpertsFactory:
    """Each MoE layer holds its routed experts [e0, e1) in this process."""
    e0, e1 = expert_range
    c = config
    return lambda layer_idx: LocalExperts(e0, e1 - e0, c.routed_expert_hidden_size, c.moe_intermediate_size,
                                          c.expert_format, c.situ_beta, c.situ_linear_beta, dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, experts: ExpertsFactory):
        super().__init__()
        c = config
        D, eps = c.hidden_size, c.rms_norm_eps
        self.layer_idx = layer_idx
        self.closes_block = c.is_block_boundary(layer_idx)
        self.eps = eps
        if c.layer_types[layer_idx] == "kda":
            self.self_attn = KimiDeltaAttention(
                layer_idx, D, c.kda_num_heads, c.kda_head_dim, c.kda_a_log_size, c.short_conv_kernel_size,
                c.gate_lower_bound, eps, dtype,
            )
        else:
            self.self_attn = GatedMLA(
                layer_idx, D, c.mla_num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                c.qk_rope_head_dim, c.v_head_dim, c.mla_use_output_gate, dtype,
            )
        self.input_layernorm = RMSNorm(D, eps, dtype)
        self.post_attention_layernorm = RMSNorm(D, eps, dtype)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False, dtype=dtype)
        self.self_attention_res_norm = RMSNorm(D, eps, dtype)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False, dtype=dtype)
        self.mlp_res_norm = RMSNorm(D, eps, dtype)
        if c.is_moe_layer(layer_idx):
            self.block_sparse_moe = StableLatentMoE(
                D, c.routed_expert_hidden_size, c.num_experts, c.num_experts_per_token, experts(layer_idx),
                c.shared_intermediate_size, c.moe_renormalize, c.routed_scaling_factor, c.latent_moe_use_norm,
                eps, c.situ_beta, c.situ_linear_beta, dtype,
            )
        else:
            self.mlp = SituMLP(D, c.intermediate_size, c.situ_beta, c.situ_linear_beta, dtype)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(
        self, prefix: torch.Tensor, bank: list[torch.Tensor], batch: ForwardBatch
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """prefix [T, D] is the running partial block sum; bank the finished blocks (embedding first)."""
        if bank:
            _, a = attn_res_rmsnorm(
                torch.stack(bank + [prefix], 1), self.self_attention_res_proj.weight,
                self.self_attention_res_norm.weight, self.input_layernorm.weight, self.eps,
            )
        else:
            a = self.input_layernorm(prefix)  # layer 0: the input is the embedding itself
        partial: torch.Tensor | None = prefix
        if self.closes_block:
            bank = bank + [prefix]
            partial = None
        y = self.self_attn(a, batch)
        partial = y if partial is None else partial + y
        _, m = attn_res_rmsnorm(
            torch.stack(bank + [partial], 1), self.mlp_res_proj.weight,
            self.mlp_res_norm.weight, self.post_attention_layernorm.weight, self.eps,
        )
        return partial + self.ffn(m), bank


class K3Model(nn.Module):
    """Holds `model.*` tensors for layers [start, end); the embedding if start == 0 and the
    output AttnRes + final norm if end == num_layers."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer_range: tuple[int, int],
                 experts: ExpertsFactory):
        super().__init__()
        start, end = layer_range
        self.config, self.start, self.end = config, start, end
        D = config.hidden_size
        if start == 0:
            self.embed_tokens = nn.Embedding(config.vocab_size, D, dtype=dtype)
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(config, i, dtype, experts) for i in range(start, end)}
        )
        if end == config.num_layers:
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False, dtype=dtype)
            self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps, dtype)
            self.norm = RMSNorm(D, config.rms_norm_eps, dtype)


class K3ForCausalLM(nn.Module):
    """`language_model.*` of a K3 checkpoint (or a slice of it: a layer range, an expert range).

    experts: builds each MoE layer's experts instead of holding experts [expert_range) here (a
    pipeline stage whose experts run elsewhere); the model then holds no routed expert tensors."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 layer_range: tuple[int, int] | None = None, expert_range: tuple[int, int] | None = None,
                 experts: ExpertsFactory | None = None):
        super().__init__()
        layer_range = layer_range or (0, config.num_layers)
        if not 0 <= layer_range[0] < layer_range[1] <= config.num_layers:
            raise ValueError(f"layer_range {layer_range} is not a non-empty range within [0, {config.num_layers}]")
        if expert_range is not None and not 0 <= expert_range[0] < expert_range[1] <= config.num_experts:
            raise ValueError(f"expert_range {expert_range} is not a non-empty range within [0, {config.num_experts}]")
        if expert_range is not None and experts is not None:
            raise ValueError("pass expert_range (experts held here) or experts (a factory), not both")
        self.config, self.dtype = config, dtype
        self.layer_range, self.expert_range = layer_range, expert_range or (0, config.num_experts)
        self.model = K3Model(config, dtype, layer_range, experts or local_experts(config, dtype, self.expert_range))
        if layer_range[1] == config.num_layers:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

    @property
    def is_first(self) -> bool:
        return self.layer_range[0] == 0

    @property
    def is_last(self) -> bool:
        return self.layer_range[1] == self.config.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward_layers(
        self, hidden: torch.Tensor, bank: list[torch.Tensor], batch: ForwardBatch
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for layer in self.model.layers.values():
            hidden, bank = layer(hidden, bank, batch)
        return hidden, bank

    def head(self, hidden: torch.Tensor, bank: list[torch.Tensor]) -> torch.Tensor:
        """Output AttnRes + final RMSNorm + lm_head -> logits [T, V] (in the model dtype)."""
        m = self.model
        _, h = attn_res_rmsnorm(
            torch.stack(bank + [hidden], 1), m.output_attn_res_proj.weight, m.output_attn_res_norm.weight,
            m.norm.weight, self.config.rms_norm_eps,
        )
        return self.lm_head(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        logits_indices: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Whole model: input_ids [T] packed -> logits [len(logits_indices) or T, V]."""
        assert self.is_first and self.is_last, "forward() needs the whole model; stages use forward_layers"
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        hidden, bank = self.forward_layers(hidden, [], batch)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
            bank = [b[logits_indices] for b in bank]
        return self.head(hidden, bank)
