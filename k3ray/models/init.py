"""Deterministic random weights for K3-shaped models (tiny checkpoints, tests, benchmarks).

Scaled so a random tiny model has peaked logits (greedy decoding is not decided by rounding)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from k3ray.kernels.moe.mxfp4 import quantize_mxfp4
from k3ray.models.k3 import K3ForCausalLM
from k3ray.models.moe import LocalExperts


@torch.no_grad()
def init_random_weights(model: K3ForCausalLM, seed: int = 0) -> K3ForCausalLM:
    gen = torch.Generator().manual_seed(seed)
    c = model.config

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_((torch.randn(t.shape, generator=gen) * std + mean).to(t.dtype))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            normal(p, 1.0)
        elif name.endswith("lm_head.weight"):
            normal(p, 4.0 / math.sqrt(c.hidden_size))
        elif "_res_proj" in name:
            normal(p, 0.5 / math.sqrt(c.hidden_size))  # AttnRes pseudo-query: zero-init in training
        elif name.endswith("norm.weight"):
            normal(p, 0.1, mean=1.0)
        elif leaf == "A_log":
            p.zero_()
            p[: c.kda_num_heads] = torch.log(torch.rand(c.kda_num_heads, generator=gen) * 15 + 1)
        elif leaf == "dt_bias":
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif leaf == "e_score_correction_bias":
            normal(p, 0.1)
        elif "conv1d" in name:
            normal(p, 0.5)
        elif p.dim() >= 2:
            normal(p, 1.0 / math.sqrt(p.shape[-1]))
        else:
            normal(p, 0.02)
    for mod in model.modules():
        if isinstance(mod, LocalExperts) and mod.fmt == "mxfp4":
            for w in ("w1", "w3", "w2"):
                packed, scale = getattr(mod, f"{w}_packed"), getattr(mod, f"{w}_scale")
                for e in range(mod.count):
                    full = torch.randn(packed.shape[1], packed.shape[2] * 2, generator=gen) / math.sqrt(packed.shape[2] * 2)
                    packed[e], scale[e] = quantize_mxfp4(full)
    return model


def build_model(config, dtype: torch.dtype = torch.float32, seed: int | None = 0,
                device: torch.device | str | None = None, **kwargs) -> K3ForCausalLM:
    """A K3ForCausalLM built on `device` (None: torch's current default, normally the CPU),
    randomly initialised with `seed` (the same values on every device; drawn on the CPU), or left
    as constructed if None (a loader fills it)."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = K3ForCausalLM(config, dtype=dtype, **kwargs)
    if seed is not None:
        init_random_weights(model, seed)
    return model.eval()


__all__ = ["build_model", "init_random_weights", "nn"]
