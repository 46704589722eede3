"""Benchmark cases for the MoE entry points (collected by `k3ray bench kernels`).

K3 per MoE layer: routing top-16 of 896 experts (fp32), and SiTU-GLU experts 3584 -> 3072 ->
3584 in MXFP4 (packed nibbles + E8M0 scales) or bf16. Expert cases hold a shard of E_local
experts with every routed id local; bytes count each used expert's weights once.
Baselines (--compare): the same experts in bf16 through torch (a loop of matmuls over experts,
and torch._grouped_mm on CUDA where torch has it) and naive.py over the case's own weights."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.bench.kernel_cases.baselines import BaselineUnavailable, require_cuda
from k3ray.kernels.moe.dispatch import moe_experts, select_experts
from k3ray.kernels.moe.mxfp4 import GROUP, dequantize_mxfp4
from k3ray.kernels.moe.naive import naive_moe_experts, naive_select_experts, situ_glu

K3_LATENT, K3_INTER = 3584, 3072
TINY_LATENT, TINY_INTER = 32, 32


def _route_case(T: int, E: int, k: int, device: str, label: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=gen).to(device)
    bias = (0.05 * torch.randn(E, generator=gen)).to(device)
    return {
        "op": "moe_route",
        "shape": f"{label} T={T} E={E} k={k}",
        "fn": lambda: select_experts(logits, bias, k),
        "bytes": T * E * 4 + E * 4 + T * k * 12,
        "flops": None,
        "baselines": {"naive_select_experts": lambda: lambda: naive_select_experts(logits, bias, k)},
    }


def _weights(E: int, out: int, inp: int, fmt: str, device: str, gen: torch.Generator):
    if fmt == "mxfp4":
        packed = torch.randint(0, 256, (E, out, inp // 2), dtype=torch.uint8, generator=gen).to(device)
        scale = torch.randint(118, 124, (E, out, inp // GROUP), dtype=torch.uint8, generator=gen).to(device)
        return packed, scale
    return (0.02 * torch.randn(E, out, inp, generator=gen)).to(device, torch.bfloat16)


def _as_bf16(w) -> torch.Tensor:
    """[E, out, in] bf16: MXFP4 (packed, scale) dequantised once, outside the timing."""
    if isinstance(w, tuple):
        return dequantize_mxfp4(w[0], w[1], torch.bfloat16)
    return w


def grouped_mm_experts(h, ids, weights, w1, w3, w2, beta: float, linear_beta: float) -> torch.Tensor:
    """bf16 experts [E, out, in] as three torch._grouped_mm calls over tokens sorted by expert."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort()
    tok = order // k  # [T * k] token of each sorted row
    offs = torch.bincount(flat, minlength=w1.shape[0]).cumsum(0).to(torch.int32)
    x = h[tok]
    a = situ_glu(torch._grouped_mm(x, w1.transpose(1, 2), offs=offs),
                 torch._grouped_mm(x, w3.transpose(1, 2), offs=offs), beta, linear_beta)
    out = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = h.new_zeros(h.shape, dtype=torch.float32)
    return y.index_add_(0, tok, out.float() * weights.reshape(-1)[order, None].float())


def _experts_case(T: int, k: int, E: int, Dl: int, I: int, fmt: str, device: str, label: str,
                  naive: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(T, Dl, generator=gen).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(device)
    weights = torch.rand(T, k, generator=gen).to(device)
    w1, w3, w2 = (_weights(E, I, Dl, fmt, device, gen), _weights(E, I, Dl, fmt, device, gen),
                  _weights(E, Dl, I, fmt, device, gen))
    used = min(E, T * k)
    per_expert = 3 * I * Dl * (2 if fmt == "bf16" else 0.5) + (0 if fmt == "bf16" else 3 * I * Dl // GROUP)
    fn = naive_moe_experts if naive else moe_experts

    def bf16_loop():
        b1, b3, b2 = (_as_bf16(w) for w in (w1, w3, w2))
        return lambda: naive_moe_experts(h, ids, weights, b1, b3, b2, 4.0, 25.0)

    def bf16_grouped():
        require_cuda(device, "torch._grouped_mm")
        if not hasattr(torch, "_grouped_mm"):
            raise BaselineUnavailable(f"torch {torch.__version__} has no _grouped_mm")
        b1, b3, b2 = (_as_bf16(w) for w in (w1, w3, w2))
        return lambda: grouped_mm_experts(h, ids, weights, b1, b3, b2, 4.0, 25.0)

    return {
        "op": f"moe_experts_{fmt}" + ("_naive" if naive else ""),
        "shape": f"{label} T={T} k={k} E_local={E} {Dl}->{I}",
        "fn": lambda: fn(h, ids, weights, w1, w3, w2, 4.0, 25.0),
        "bytes": int(used * per_expert) + T * Dl * (2 + 4),
        "flops": 6 * T * k * I * Dl,
        "baselines": {} if naive else {
            "torch.bf16_expert_loop": bf16_loop,
            "torch.bf16_grouped_mm": bf16_grouped,
            "naive_moe_experts": lambda: lambda: naive_moe_experts(h, ids, weights, w1, w3, w2, 4.0, 25.0),
        },
    }


def cases(device: str, quick: bool) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    route_T = (8192 if cuda else 256) // (4 if quick else 1)
    out = [
        _route_case(16, 8, 2, device, "k3-tiny"),
        _route_case(route_T, 896, 16, device, "k3"),
        _experts_case(16, 2, 8, TINY_LATENT, TINY_INTER, "bf16", device, "k3-tiny"),
    ]
    if cuda:  # one expert shard: decode (a few rows per expert) and prefill (hundreds per expert)
        shapes = [(64, 16, 64), (2048, 16, 64)] if not quick else [(64, 16, 64)]
    else:
        shapes = [(8, 2, 4)] if not quick else [(2, 2, 2)]
    for T, k, E in shapes:
        out.append(_experts_case(T, k, E, K3_LATENT, K3_INTER, "mxfp4", device, "k3"))
        if not quick:
            out.append(_experts_case(T, k, E, K3_LATENT, K3_INTER, "bf16", device, "k3"))
    if not cuda and not quick:
        T, k, E = shapes[0]
        out.append(_experts_case(T, k, E, K3_LATENT, K3_INTER, "mxfp4", device, "k3", naive=True))
    return out
