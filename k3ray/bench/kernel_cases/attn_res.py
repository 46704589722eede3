"""Benchmark cases for AttnRes + RMSNorm (collected by `k3ray bench kernels`).

K3's deepest layers aggregate 9 sources of width 7168; the op reads every source once and
writes the aggregate and its normed copy (bf16). Baseline (--compare): naive.py (no maintained
library has this op)."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.kernels.attn_res.dispatch import attn_res_rmsnorm
from k3ray.kernels.attn_res.naive import naive_attn_res_rmsnorm

K3_HIDDEN = 7168


def _case(T: int, R: int, D: int, device: str, label: str, naive: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    sources = torch.randn(T, R, D, generator=gen).to(device, torch.bfloat16)
    proj = (0.1 * torch.randn(1, D, generator=gen)).to(device, torch.bfloat16)
    res_w = torch.ones(D, device=device, dtype=torch.bfloat16)
    out_w = torch.ones(D, device=device, dtype=torch.bfloat16)
    fn = naive_attn_res_rmsnorm if naive else attn_res_rmsnorm
    return {
        "op": "attn_res_rmsnorm_naive" if naive else "attn_res_rmsnorm",
        "shape": f"{label} T={T} R={R} D={D}",
        "fn": lambda: fn(sources, proj, res_w, out_w, 1e-5),
        "bytes": (T * R * D + 2 * T * D + 3 * D) * 2,
        "flops": T * D * (4 * R + 6),  # squares and dots per source, the mix, the norm
        "baselines": {} if naive else {"naive_attn_res_rmsnorm": lambda: lambda: naive_attn_res_rmsnorm(
            sources, proj, res_w, out_w, 1e-5)},
    }


def cases(device: str, quick: bool) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    T = (8192 if cuda else 64) // (4 if quick else 1)
    out = [_case(16, 3, 64, device, "k3-tiny"), _case(T, 9, K3_HIDDEN, device, "k3")]
    if not quick:
        out.append(_case(T, 2, K3_HIDDEN, device, "k3"))  # the shallow layers: two sources
    if not cuda:
        out.append(_case(T, 9, K3_HIDDEN, device, "k3", naive=True))
    return out
