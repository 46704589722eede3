"""KDA's Triton launches at K3's shapes, for `k3ray bench compile` (CPU tensors: only shapes,
dtypes and the host-side bookkeeping matter; nothing runs)."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.bench.kernel_cases.kda import K3_HEAD_DIM, K3_HEADS
from k3ray.kernels.kda.chunk_triton import chunk_kda_triton
from k3ray.kernels.kda.fused_recurrent_triton import fused_recurrent_kda_triton


def _inputs(T: int, H: int, K: int):
    qkv = torch.zeros(T, H, K, dtype=torch.bfloat16)
    return qkv, qkv, qkv, torch.full((T, H, K), -0.1), torch.full((T, H), 0.5)


def launches() -> list[dict[str, Any]]:
    H, K = K3_HEADS, K3_HEAD_DIM
    T, N, q_len = 4096, 64, 5
    prefill = _inputs(T, H, K)
    decode = _inputs(N, H, K)
    spec = _inputs(N * q_len, H, K)
    pool = torch.empty(N * (q_len + 1), H, K, K)  # [slots, H, K, V] fp32, never touched
    slots = torch.arange(N)
    return [
        {"op": "kda_chunk_prefill", "shape": f"k3 T={T} (2 seqs) H={H} K=V={K}",
         "fn": lambda: chunk_kda_triton(*prefill, K**-0.5, torch.zeros(2, H, K, K), torch.tensor([0, 1000, T]))},
        {"op": "kda_decode", "shape": f"k3 N={N} H={H}",
         "fn": lambda: fused_recurrent_kda_triton(*decode, K**-0.5, pool, slots, torch.arange(N + 1), slots)},
        {"op": "kda_spec_verify", "shape": f"k3 N={N} q_len={q_len} H={H}",
         "fn": lambda: fused_recurrent_kda_triton(*spec, K**-0.5, pool, slots, torch.arange(0, N * q_len + 1, q_len),
                                                  N + torch.arange(N * q_len).view(N, q_len))},
    ]
