"""The short conv's Triton launches at K3's width, for `k3ray bench compile` (CPU tensors: only
shapes, dtypes and the host-side bookkeeping matter; nothing runs)."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.bench.kernel_cases.conv import K3_CHANNELS, WIDTH
from k3ray.kernels.conv.causal_conv1d_triton import causal_conv1d_spec_triton, causal_conv1d_triton


def launches() -> list[dict[str, Any]]:
    D, T, N, q_len = K3_CHANNELS, 4096, 64, 5
    weight = torch.zeros(D, WIDTH)
    x = torch.zeros(T, D, dtype=torch.bfloat16)
    pool = torch.zeros(N * (q_len + 1), D, WIDTH - 1, dtype=torch.bfloat16)
    slots = torch.arange(N)
    return [
        {"op": "conv_prefill", "shape": f"k3 T={T} D={D} W={WIDTH}",
         "fn": lambda: causal_conv1d_triton(x, weight, torch.tensor([0, T]), torch.zeros(1, D, WIDTH - 1, dtype=x.dtype))},
        {"op": "conv_decode", "shape": f"k3 N={N} D={D} W={WIDTH}",
         "fn": lambda: causal_conv1d_spec_triton(x[:N], weight, torch.arange(N + 1), pool, slots, slots[:, None])},
        {"op": "conv_spec_verify", "shape": f"k3 N={N} q_len={q_len} D={D} W={WIDTH}",
         "fn": lambda: causal_conv1d_spec_triton(x[:N * q_len], weight, torch.arange(0, N * q_len + 1, q_len), pool,
                                                 slots, N + torch.arange(N * q_len).view(N, q_len))},
    ]
