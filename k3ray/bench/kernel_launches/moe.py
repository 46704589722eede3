"""The MoE's Triton launches at K3's shapes, for `k3ray bench compile` (CPU tensors: only shapes,
dtypes and the host-side bookkeeping matter; nothing runs)."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.bench.kernel_cases.moe import K3_INTER, K3_LATENT
from k3ray.kernels.moe.experts_triton import moe_experts_triton
from k3ray.kernels.moe.mxfp4 import GROUP
from k3ray.kernels.moe.select_experts_triton import select_experts_triton

EXPERTS, LOCAL_EXPERTS, TOP_K = 896, 64, 16


def _weight(E: int, out: int, inp: int, fmt: str):
    if fmt == "mxfp4":  # packed nibbles + E8M0 scales, never touched
        return torch.empty(E, out, inp // 2, dtype=torch.uint8), torch.empty(E, out, inp // GROUP, dtype=torch.uint8)
    return torch.empty(E, out, inp, dtype=torch.bfloat16)


def _experts(T: int, fmt: str) -> dict[str, Any]:
    E, Dl, I = LOCAL_EXPERTS, K3_LATENT, K3_INTER
    h = torch.zeros(T, Dl, dtype=torch.bfloat16)
    ids = (torch.arange(T * TOP_K) % E).view(T, TOP_K)  # every expert used, as a shard sees at load
    w1, w3, w2 = _weight(E, I, Dl, fmt), _weight(E, I, Dl, fmt), _weight(E, Dl, I, fmt)
    return {"op": f"moe_experts_{fmt}", "shape": f"k3 T={T} k={TOP_K} E_local={E} {Dl}->{I}",
            "fn": lambda: moe_experts_triton(h, ids, torch.full((T, TOP_K), 1 / TOP_K), w1, w3, w2, 4.0, 25.0)}


def launches() -> list[dict[str, Any]]:
    T = 8192
    logits = torch.zeros(T, EXPERTS)
    route = {"op": "moe_route", "shape": f"k3 T={T} E={EXPERTS} k={TOP_K}",
             "fn": lambda: select_experts_triton(logits, torch.zeros(EXPERTS), TOP_K)}
    return [route] + [_experts(T, fmt) for T in (64, 2048) for fmt in ("mxfp4", "bf16")]
