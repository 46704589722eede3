"""Side-by-side baselines for the benchmark cases (`k3ray bench kernels --compare`).

A case in kernel_cases/<op>.py may carry `"baselines": {name: factory}`; each factory builds
the callable to time beside the case's own `fn` (same inputs, same work), or raises
BaselineUnavailable saying why it cannot run on this machine (fla-core's kernels need CUDA).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


class BaselineUnavailable(RuntimeError):
    """A baseline that cannot run here; its message is reported instead of a time."""


def require_cuda(device: str, what: str) -> None:
    if not device.startswith("cuda"):
        raise BaselineUnavailable(f"{what} needs CUDA")


def fla_function(module: str, name: str, device: str) -> Any:
    """fla-core's `module.name` (Triton kernels: CUDA only), imported on demand."""
    require_cuda(device, f"fla-core {name}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise BaselineUnavailable(f"fla-core is not installed ({e})") from e
