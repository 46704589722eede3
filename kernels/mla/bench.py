"""Benchmark cases for the MLA entry points (collected by `k3ray bench kernels`).

K3 per MLA layer: 96 heads, a 576-wide bf16 latent cache (512 + 64), q/k head 192, v head 128.
Decode moves the whole cache once (bytes); prefill counts the causal QK^T and PV flops.
"""

from __future__ import annotations

from typing import Any

import torch

from k3ray.kernels.mla.dispatch import mla_decode, mla_prefill
from k3ray.kernels.mla.naive import naive_paged_mla_decode

K3 = dict(H=96, L=512, R=64, dqk=192, dv=128)
TINY = dict(H=2, L=16, R=8, dqk=24, dv=16)
BLOCK = 64


def _decode_case(dims: dict, N: int, ctx: int, device: str, label: str, naive: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    D = dims["L"] + dims["R"]
    blocks = N * (-(-ctx // BLOCK))
    cache = torch.randn(blocks * BLOCK, D, generator=gen).to(device, torch.bfloat16)
    table = torch.randperm(blocks, generator=gen).view(N, -1).to(device, torch.int32)
    lens = torch.full((N,), ctx, device=device)
    q = torch.randn(N, dims["H"], D, generator=gen).to(device, torch.bfloat16)
    fn = naive_paged_mla_decode if naive else mla_decode
    return {
        "op": "mla_decode_naive" if naive else "mla_decode",
        "shape": f"{label} N={N} H={dims['H']} ctx={ctx} latent={D}",
        "fn": lambda: fn(q, cache, table, lens, BLOCK, dims["L"], 192**-0.5),
        "bytes": N * ctx * D * 2 + q.numel() * 2 + N * dims["H"] * dims["L"] * 2,
        "flops": 2 * N * dims["H"] * ctx * (D + dims["L"]),
    }


def _prefill_case(dims: dict, lens: list[int], device: str, label: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    T, H = sum(lens), dims["H"]
    q = torch.randn(T, H, dims["dqk"], generator=gen).to(device, torch.bfloat16)
    k = torch.randn(T, H, dims["dqk"], generator=gen).to(device, torch.bfloat16)
    v = torch.randn(T, H, dims["dv"], generator=gen).to(device, torch.bfloat16)
    cu = torch.tensor([0] + lens).cumsum(0).to(device)
    pairs = sum(n * (n + 1) // 2 for n in lens)  # causal (query, key) pairs
    return {
        "op": "mla_prefill",
        "shape": f"{label} seqs={len(lens)} T={T} H={H} dqk={dims['dqk']} dv={dims['dv']}",
        "fn": lambda: mla_prefill(q, k, v, cu, cu, 192**-0.5),
        "bytes": (q.numel() + k.numel() + 2 * v.numel()) * 2,
        "flops": 2 * H * pairs * (dims["dqk"] + dims["dv"]),
    }


def cases(device: str, quick: bool) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    if cuda:
        decode = [(64, 8192), (4, 131072 if not quick else 32768)]
        prefill = [4096, 4096] if not quick else [2048]
    else:
        decode = [(2, 8192)] if not quick else [(1, 2048)]
        prefill = [384, 128] if not quick else [128]
    out = [_decode_case(TINY, 4, 100, device, "k3-tiny"), _prefill_case(TINY, [37, 64], device, "k3-tiny")]
    out += [_decode_case(K3, N, ctx, device, "k3") for N, ctx in decode]
    out.append(_prefill_case(K3, prefill, device, "k3"))
    if not cuda:  # the reference at the same K3 decode shape, for the CPU speed-up
        out.append(_decode_case(K3, *decode[0], device, "k3", naive=True))
    return out
