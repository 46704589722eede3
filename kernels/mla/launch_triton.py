"""Launch helpers shared by the MLA Triton kernels."""

from __future__ import annotations

import torch
import triton

MIN_DOT = 16  # tl.dot needs every dimension >= 16


def pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def dot_args(t: torch.Tensor) -> dict:
    """DOT_F32: the CPU interpreter multiplies bf16 tiles as raw uint16 (triton 3.9), so upcast
    there; DOT_PREC: fp32 inputs use IEEE products on the GPU instead of TF32."""
    return {"DOT_F32": t.device.type != "cuda", "DOT_PREC": "ieee" if t.dtype == torch.float32 else "tf32"}
