"""Benchmark cases for the MoE entry points (collected by `k3ray bench kernels`).

K3 per MoE layer: routing top-16 of 896 experts (fp32), and SiTU-GLU experts 3584 -> 3072 ->
3584 in MXFP4 (packed nibbles + E8M0 scales) or bf16. Expert cases hold a shard of E_local
experts with every routed id local; bytes count each used expert's weights once."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.kernels.moe.dispatch import moe_experts, select_experts
from k3ray.kernels.moe.mxfp4 import GROUP
from k3ray.kernels.moe.naive import naive_moe_experts

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
    }


def _weights(E: int, out: int, inp: int, fmt: str, device: str, gen: torch.Generator):
    if fmt == "mxfp4":
        packed = torch.randint(0, 256, (E, out, inp // 2), dtype=torch.uint8, generator=gen).to(device)
        scale = torch.randint(118, 124, (E, out, inp // GROUP), dtype=torch.uint8, generator=gen).to(device)
        return packed, scale
    return (0.02 * torch.randn(E, out, inp, generator=gen)).to(device, torch.bfloat16)


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
    return {
        "op": f"moe_experts_{fmt}" + ("_naive" if naive else ""),
        "shape": f"{label} T={T} k={k} E_local={E} {Dl}->{I}",
        "fn": lambda: fn(h, ids, weights, w1, w3, w2, 4.0, 25.0),
        "bytes": int(used * per_expert) + T * Dl * (2 + 4),
        "flops": 6 * T * k * I * Dl,
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
