"""MoE entry points: routing and the grouped expert computation (bf16 or MXFP4 weights)."""

from __future__ import annotations

import torch

from k3ray.kernels.moe.naive import naive_moe_experts, naive_route


def route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool = True, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    return naive_route(logits, bias, top_k, renormalize, scaling)


def moe_experts(h, ids, weights, w1, w3, w2, beta: float, linear_beta: float, expert_offset: int = 0) -> torch.Tensor:
    return naive_moe_experts(h, ids, weights, w1, w3, w2, beta, linear_beta, expert_offset)
