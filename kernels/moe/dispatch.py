"""MoE entry points: routing and the grouped expert computation (bf16/fp32 or MXFP4 weights).
Triton on CUDA tensors, PyTorch on CPU tensors; references in naive.py."""

from __future__ import annotations

import torch

from k3ray.kernels.moe.experts_cpu import moe_experts_cpu
from k3ray.kernels.moe.experts_triton import moe_experts_triton
from k3ray.kernels.moe.mxfp4 import GROUP
from k3ray.kernels.moe.naive import naive_select_experts
from k3ray.kernels.moe.select_experts_triton import select_experts_triton


def select_experts(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool = True, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64): sigmoid scores, top-k of
    score + bias (selection only), weights renormalised over the k and scaled."""
    if logits.dim() != 2 or bias.shape != (logits.shape[1],):
        raise ValueError(f"expected logits [T, E] and bias [E]; got {list(logits.shape)} and {list(bias.shape)}")
    if not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}], got {top_k}")
    if logits.is_cuda:
        return select_experts_triton(logits, bias, top_k, renormalize, scaling)
    return naive_select_experts(logits, bias, top_k, renormalize, scaling)  # one topk over [T, E]: already vectorised


def _shape(w) -> tuple[int, int, int]:
    """(E, out, in) of a dense [E, out, in] weight or an MXFP4 pair ([E, out, in/2], [E, out, in/32])."""
    if isinstance(w, tuple):
        packed, scale = w
        if packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.dim() != 3:
            raise ValueError(f"an MXFP4 weight is (packed [E, out, in/2] uint8, scale [E, out, in/32] uint8), "
                             f"got {packed.dtype} {list(packed.shape)} and {scale.dtype} {list(scale.shape)}")
        E, out, half = packed.shape
        if scale.shape != (E, out, 2 * half // GROUP):
            raise ValueError(f"MXFP4 scale must be {[E, out, 2 * half // GROUP]}, got {list(scale.shape)}")
        return E, out, 2 * half
    if w.dim() != 3:
        raise ValueError(f"a dense expert weight must be [E, out, in], got {list(w.shape)}")
    return tuple(w.shape)


def moe_experts(h, ids, weights, w1, w3, w2, beta: float, linear_beta: float, expert_offset: int = 0,
                every_expert_weights=None) -> torch.Tensor:
    """y [T, Dl] fp32 = sum_k weights[:, k] * E_{ids[:, k]}(h), E_e(h) = w2_e SiTU(w1_e h, w3_e h),
    over the experts held here (ids in [expert_offset, expert_offset + E_local)); other ids add 0.

    h [T, Dl]; ids, weights [T, k]; w1, w3 [E_local, I, Dl], w2 [E_local, Dl, I] (dense or MXFP4);
    every_expert_weights: optional cache for the CPU path (moe_experts_cpu)."""
    (E, I, Dl), s3, s2 = _shape(w1), _shape(w3), _shape(w2)
    if h.dim() != 2 or h.shape[1] != Dl or s3 != (E, I, Dl) or s2 != (E, Dl, I):
        raise ValueError(f"expected h [T, {Dl}], w3 {[E, I, Dl]}, w2 {[E, Dl, I]}; got h {list(h.shape)}, "
                         f"w3 {list(s3)}, w2 {list(s2)}")
    if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != h.shape[0]:
        raise ValueError(
            f"ids and weights must both be [{h.shape[0]}, k]; got {list(ids.shape)} and {list(weights.shape)}"
        )
    if h.is_cuda:
        return moe_experts_triton(h, ids, weights, w1, w3, w2, beta, linear_beta, expert_offset)
    return moe_experts_cpu(h, ids, weights, w1, w3, w2, beta, linear_beta, expert_offset, every_expert_weights)
