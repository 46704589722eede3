"""AttnRes + RMSNorm's Triton launches at K3's width, for `k3ray bench compile` (CPU tensors:
only shapes and dtypes matter; nothing runs)."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.kernels.attn_res.attn_res_triton import attn_res_rmsnorm_triton
from k3ray.bench.kernel_cases.attn_res import K3_HIDDEN


def _case(T: int, R: int) -> dict[str, Any]:
    D = K3_HIDDEN
    sources = torch.zeros(T, R, D, dtype=torch.bfloat16)
    w = torch.ones(D, dtype=torch.bfloat16)
    return {"op": "attn_res_rmsnorm", "shape": f"k3 T={T} R={R} D={D}",
            "fn": lambda: attn_res_rmsnorm_triton(sources, w[None], w, w, 1e-5)}


def launches() -> list[dict[str, Any]]:
    return [_case(8192, 9), _case(64, 9), _case(64, 2)]
