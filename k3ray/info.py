"""Parameter counts and per-sequence memory of a K3 config, computed on the meta device."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from k3ray.config import ModelConfig
from k3ray.models.k3 import K3ForCausalLM
from k3ray.models.moe import LocalExperts

CATEGORIES = (
    "embedding", "lm_head", "kda", "mla", "dense_mlp", "router", "latent_proj", "routed_experts",
    "shared_experts", "norms_and_attn_res",
)


@dataclass(frozen=True)
class ModelSummary:
    config: ModelConfig
    params: dict[str, int]  # per category, routed experts as logical weights (MXFP4 unpacked)
    per_layer: dict[str, int]  # one layer's mixer / routed-expert parameters by type
    weight_bytes: int  # as published: MXFP4 experts at 4.25 bits, fp32 exceptions, bf16 elsewhere

    @property
    def total(self) -> int:
        return sum(self.params.values())

    @property
    def active(self) -> int:
        """Parameters used per token: all but the unselected routed experts and the embedding
        table (a row lookup); the untied lm_head counts."""
        c = self.config
        routed = self.params["routed_experts"]
        unselected = routed - routed * c.num_experts_per_token // c.num_experts
        return self.total - unselected - self.params["embedding"]


def _category(config: ModelConfig, name: str) -> str:
    parts = name.split(".")
    if name.startswith("model.layers.") and parts[3] == "self_attn":
        return config.layer_types[int(parts[2])]  # "kda" or "mla"
    for key, cat in (
        ("embed_tokens", "embedding"), ("lm_head", "lm_head"), (".shared_experts.", "shared_experts"),
        (".experts.", "routed_experts"), (".gate.", "router"), (".routed_expert_", "latent_proj"),
        (".mlp.", "dense_mlp"),
    ):
        if key in name:
            return cat
    return "norms_and_attn_res"


def summarize(config: ModelConfig) -> ModelSummary:
    with torch.device("meta"):
        model = K3ForCausalLM(config, dtype=torch.bfloat16)
    params: dict[str, int] = defaultdict(int)
    weight_bytes = 0
    per_layer: dict[str, int] = {}
    for name, p in model.named_parameters():
        params[_category(config, name)] += p.numel()
        weight_bytes += p.numel() * (4 if p.dtype == torch.float32 else 2)
    for mod in model.modules():
        if isinstance(mod, LocalExperts) and mod.fmt == "mxfp4":
            for w in ("w1", "w3", "w2"):
                packed, scale = getattr(mod, f"{w}_packed"), getattr(mod, f"{w}_scale")
                params["routed_experts"] += packed.numel() * 2
                weight_bytes += packed.numel() + scale.numel()
    for lt, idx in (("kda", config.kda_layer_ids), ("mla", config.mla_layer_ids)):
        if idx:
            per_layer[lt] = sum(p.numel() for p in model.model.layers[str(idx[0])].self_attn.parameters())
    moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
    if moe_layers:
        per_layer["routed_experts"] = params["routed_experts"] // len(moe_layers)
    return ModelSummary(config, {c: params.get(c, 0) for c in CATEGORIES}, per_layer, weight_bytes)


@dataclass(frozen=True)
class SequenceMemory:
    kda_state_bytes: int  # fp32 recurrent state, all KDA layers
    conv_state_bytes: int  # short-conv windows, all KDA layers
    mla_bytes_per_token: int  # latent cache, all MLA layers
    context_len: int

    @property
    def mla_bytes(self) -> int:
        return self.mla_bytes_per_token * self.context_len

    @property
    def total_bytes(self) -> int:
        return self.kda_state_bytes + self.conv_state_bytes + self.mla_bytes


def sequence_memory(config: ModelConfig, context_len: int, cache_dtype_bytes: int = 2) -> SequenceMemory:
    """Cache memory of one sequence: KDA state is constant, the MLA latent grows per token."""
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    n_kda, n_mla = len(config.kda_layer_ids), len(config.mla_layer_ids)
    H, K = config.kda_num_heads, config.kda_head_dim
    return SequenceMemory(
        kda_state_bytes=n_kda * H * K * K * 4,
        conv_state_bytes=n_kda * 3 * H * K * (config.short_conv_kernel_size - 1) * cache_dtype_bytes,
        mla_bytes_per_token=n_mla * config.mla_latent_dim * cache_dtype_bytes,
        context_len=context_len,
    )
