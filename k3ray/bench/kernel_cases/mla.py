"""Benchmark cases for the MLA entry points (collected by `k3ray bench kernels`).

K3 per MLA layer: 96 heads, a 576-wide bf16 latent cache (512 + 64), q/k head 192, v head 128.
Decode moves the whole cache once (bytes); prefill counts the causal QK^T and PV flops.
Baselines (--compare): decode, a torch gather + matmul over the same pages and naive.py
(FlashMLA / FlashInfer do not install on an offline host: decode is judged by roofline_frac);
prefill, torch SDPA per sequence and naive.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from k3ray.kernels.mla.dispatch import mla_decode, mla_prefill
from k3ray.kernels.mla.naive import naive_mla_attention, naive_paged_mla_decode

K3 = dict(H=96, L=512, R=64, dqk=192, dv=128)
TINY = dict(H=2, L=16, R=8, dqk=24, dv=16)
BLOCK = 64


def torch_paged_decode(q, cache, table, lens, block, L, scale):
    """All sequences' pages gathered at once, then batched matmuls and an fp32 softmax."""
    pos = torch.arange(table.shape[1] * block, device=q.device)  # [P] positions a table can hold
    slots = table.long()[:, pos // block] * block + pos % block  # [N, P]
    lat = cache[slots]  # [N, P, L + R]
    s = (q @ lat.transpose(1, 2)).float() * scale  # [N, H, P]
    s = s.masked_fill(pos[None, None, :] >= lens[:, None, None], float("-inf"))
    return s.softmax(-1).to(lat.dtype) @ lat[..., :L]  # [N, H, L]


def _decode_case(dims: dict, N: int, ctx: int, device: str, label: str, naive: bool = False) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    D = dims["L"] + dims["R"]
    blocks = N * (-(-ctx // BLOCK))
    cache = torch.randn(blocks * BLOCK, D, generator=gen).to(device, torch.bfloat16)
    table = torch.randperm(blocks, generator=gen).view(N, -1).to(device, torch.int32)
    lens = torch.full((N,), ctx, device=device)
    q = torch.randn(N, dims["H"], D, generator=gen).to(device, torch.bfloat16)
    fn = naive_paged_mla_decode if naive else mla_decode
    args = (q, cache, table, lens, BLOCK, dims["L"], 192**-0.5)
    return {
        "op": "mla_decode_naive" if naive else "mla_decode",
        "shape": f"{label} N={N} H={dims['H']} ctx={ctx} latent={D}",
        "fn": lambda: fn(*args),
        "bytes": N * ctx * D * 2 + q.numel() * 2 + N * dims["H"] * dims["L"] * 2,
        "flops": 2 * N * dims["H"] * ctx * (D + dims["L"]),
        "baselines": {} if naive else {
            "torch.gather_matmul": lambda: lambda: torch_paged_decode(*args),
            "naive_paged_mla_decode": lambda: lambda: naive_paged_mla_decode(*args),
        },
    }


def _prefill_case(dims: dict, lens: list[int], device: str, label: str) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    T, H = sum(lens), dims["H"]
    q = torch.randn(T, H, dims["dqk"], generator=gen).to(device, torch.bfloat16)
    k = torch.randn(T, H, dims["dqk"], generator=gen).to(device, torch.bfloat16)
    v = torch.randn(T, H, dims["dv"], generator=gen).to(device, torch.bfloat16)
    cu = torch.tensor([0] + lens).cumsum(0).to(device)
    pairs = sum(n * (n + 1) // 2 for n in lens)  # causal (query, key) pairs
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

    def sdpa():  # [1, H, L, D] per sequence, causal
        for s, e in bounds:
            F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)),
                                           is_causal=True, scale=192**-0.5)

    def naive():
        for s, e in bounds:
            naive_mla_attention(q[s:e], k[s:e], v[s:e], 192**-0.5)

    return {
        "op": "mla_prefill",
        "shape": f"{label} seqs={len(lens)} T={T} H={H} dqk={dims['dqk']} dv={dims['dv']}",
        "fn": lambda: mla_prefill(q, k, v, cu, cu, 192**-0.5),
        "bytes": (q.numel() + k.numel() + 2 * v.numel()) * 2,
        "flops": 2 * H * pairs * (dims["dqk"] + dims["dv"]),
        "baselines": {"torch.sdpa": lambda: sdpa, "naive_mla_attention": lambda: naive},
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
