"""MLA's Triton launches at K3's shapes, for `k3ray bench compile` (CPU tensors: only shapes,
dtypes and the host-side bookkeeping matter; nothing runs). Decode splits the context as it would
on an H200 (132 multiprocessors)."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.bench.kernel_cases.mla import BLOCK, K3
from k3ray.kernels.mla.decode_triton import default_num_splits, mla_decode_triton
from k3ray.kernels.mla.prefill_triton import mla_prefill_triton
from k3ray.kernels.offline_compile import H200


def _decode(N: int, ctx: int):
    D, H, L = K3["L"] + K3["R"], K3["H"], K3["L"]
    blocks = N * (-(-ctx // BLOCK))
    cache = torch.empty(blocks * BLOCK, D, dtype=torch.bfloat16)  # never touched
    table = torch.arange(blocks, dtype=torch.int32).view(N, -1)
    q = torch.zeros(N, H, D, dtype=torch.bfloat16)
    splits = default_num_splits(N, H, ctx, H200.multiprocessors)
    return {"op": "mla_decode", "shape": f"k3 N={N} H={H} ctx={ctx} latent={D} splits={splits}",
            "fn": lambda: mla_decode_triton(q, cache, table, torch.full((N,), ctx), BLOCK, L, 192**-0.5,
                                            num_splits=splits)}


def _prefill(lens: list[int]):
    T, H = sum(lens), K3["H"]
    qk = torch.zeros(T, H, K3["dqk"], dtype=torch.bfloat16)
    v = torch.zeros(T, H, K3["dv"], dtype=torch.bfloat16)
    cu = torch.tensor([0] + lens).cumsum(0)
    return {"op": "mla_prefill", "shape": f"k3 seqs={len(lens)} T={T} H={H} dqk={K3['dqk']} dv={K3['dv']}",
            "fn": lambda: mla_prefill_triton(qk, qk, v, cu, cu, 192**-0.5)}


def launches() -> list[dict[str, Any]]:
    return [_decode(64, 8192), _decode(4, 131072), _prefill([4096, 4096])]
