"""The dot settings the Triton kernels share: how tiles are multiplied under the CPU interpreter
and on a GPU."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def dot_args(t: torch.Tensor) -> dict:
    """DOT_F32: the interpreter multiplies bf16 tiles as raw uint16 (triton 3.9), so upcast there;
    DOT_PREC: fp32 inputs use IEEE products on the GPU instead of TF32."""
    return {"DOT_F32": interpreting(), "DOT_PREC": "ieee" if t.dtype == torch.float32 else "tf32"}
