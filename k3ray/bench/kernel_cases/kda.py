"""Benchmark cases for the KDA entry points (collected by `k3ray bench kernels`).

Bytes count the unavoidable traffic (inputs, outputs, states read and written once); flops count
the chunkwise algorithm's multiply-adds (x2) at chunk 64, not the factorisation overhead.
Baselines (--compare): fla-core's `chunk_kda` / `fused_recurrent_kda` (CUDA) and naive.py.
"""

from __future__ import annotations

from typing import Any

import torch

from k3ray.bench.kernel_cases.baselines import fla_function
from k3ray.kernels.kda.dispatch import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_spec
from k3ray.kernels.kda.naive import l2norm, naive_chunk_kda, naive_recurrent_kda, naive_recurrent_kda_spec

K3_HEADS, K3_HEAD_DIM = 96, 128
TINY_HEADS, TINY_HEAD_DIM = 2, 32
CHUNK = 64


def make_inputs(T: int, H: int, K: int, V: int, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Random q, k (L2-normalised), v in dtype; g in (-5, 0) and beta in (0, 1) in fp32."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, K, generator=gen)).to(device, dtype)
    k = l2norm(torch.randn(T, H, K, generator=gen)).to(device, dtype)
    v = torch.randn(T, H, V, generator=gen).to(device, dtype)
    g = (-5.0 * torch.sigmoid(torch.randn(T, H, K, generator=gen))).to(device)
    beta = torch.rand(T, H, generator=gen).sigmoid().to(device)
    return q, k, v, g, beta


def chunk_flops(T: int, H: int, K: int, V: int) -> int:
    C = CHUNK
    macs_per_chunk = 2 * C * C * K + C * C * (K + V) // 2 + 3 * C * K * V + C * C * V
    return 2 * macs_per_chunk * -(-T // C) * H


def _io_bytes(T: int, H: int, K: int, V: int, dtype: torch.dtype, states: int) -> int:
    e = torch.finfo(dtype).bits // 8
    return T * H * (2 * K * e + K * 4 + 4 + 2 * V * e) + states * H * K * V * 4


def _prefill_case(T: int, H: int, K: int, device: str, label: str) -> dict[str, Any]:
    q, k, v, g, beta = make_inputs(T, H, K, K, device)
    S0 = torch.zeros(1, H, K, K, device=device)
    cu = torch.tensor([0, T], device=device)
    batched = [x[None] for x in (q, k, v, g, beta)]  # [1, T, ...]: fla's layout, one sequence

    def fla_chunk(**gate):
        fn = fla_function("fla.ops.kda", "chunk_kda", device)
        return lambda: fn(*batched, scale=K**-0.5, initial_state=S0, output_final_state=True,
                          cu_seqlens=cu.long(), **gate)

    return {
        "op": "kda_chunk_prefill",
        "shape": f"{label} T={T} H={H} K=V={K}",
        "fn": lambda: chunk_kda(q, k, v, g, beta, K**-0.5, S0, cu),
        "bytes": _io_bytes(T, H, K, K, q.dtype, states=2),
        "flops": chunk_flops(T, H, K, K),
        "baselines": {
            "fla.chunk_kda": fla_chunk,
            # K3's gate is bounded below by -5: fla's tensor-core path for bounded gates
            "fla.chunk_kda(safe_gate)": lambda: fla_chunk(safe_gate=True, lower_bound=-5.0),
            "naive_chunk_kda": lambda: lambda: naive_chunk_kda(*batched, K**-0.5, S0, True),
        },
    }


def _decode_case(N: int, H: int, K: int, device: str, label: str) -> dict[str, Any]:
    q, k, v, g, beta = make_inputs(N, H, K, K, device)
    pool = torch.zeros(2 * N, H, K, K, device=device)
    slots = torch.arange(0, 2 * N, 2, device=device)
    per_seq = [x[:, None] for x in (q, k, v, g, beta)]  # [N, 1, ...]: one token per sequence

    def fla_decode():  # vLLM's call: states read and written in place at the pool's slots
        fn = fla_function("fla.ops.kda.fused_recurrent", "fused_recurrent_kda_fwd", device)
        return lambda: fn(*per_seq, scale=K**-0.5, initial_state=pool, inplace_final_state=True,
                          ssm_state_indices=slots)

    def naive_decode():
        _, S = naive_recurrent_kda(*per_seq, K**-0.5, pool[slots], True)
        pool[slots] = S

    return {
        "op": "kda_decode",
        "shape": f"{label} N={N} H={H} K=V={K}",
        "fn": lambda: fused_recurrent_kda(q, k, v, g, beta, K**-0.5, pool, slots),
        "bytes": _io_bytes(N, H, K, K, q.dtype, states=2 * N),
        "flops": 7 * N * H * K * K,  # decay, k^T S, rank-1 update, q^T S per state element
        "baselines": {"fla.fused_recurrent_kda": fla_decode, "naive_recurrent_kda": lambda: naive_decode},
    }


def _spec_case(N: int, q_len: int, H: int, K: int, device: str, label: str) -> dict[str, Any]:
    T = N * q_len
    q, k, v, g, beta = make_inputs(T, H, K, K, device)
    pool = torch.zeros(N * (q_len + 1), H, K, K, device=device)
    initial = torch.arange(N, device=device)
    out = N + torch.arange(N * q_len, device=device).view(N, q_len)
    cu = torch.arange(0, T + 1, q_len, device=device)
    packed = [x[None] for x in (q, k, v, g, beta)]  # [1, T, ...]

    def fla_spec():  # vLLM's call: per-token state slots; the initial state is the first slot's
        fn = fla_function("fla.ops.kda.fused_recurrent", "fused_recurrent_kda_fwd", device)
        accepted = torch.ones(N, dtype=torch.int32, device=device)
        return lambda: fn(*packed, scale=K**-0.5, initial_state=pool, inplace_final_state=True,
                          cu_seqlens=cu.long(), ssm_state_indices=out, num_accepted_tokens=accepted)

    return {
        "op": "kda_spec_verify",
        "shape": f"{label} N={N} q_len={q_len} H={H} K=V={K}",
        "fn": lambda: fused_recurrent_kda_spec(q, k, v, g, beta, K**-0.5, pool, initial, cu, out),
        "bytes": _io_bytes(T, H, K, K, q.dtype, states=N + T),
        "flops": 7 * T * H * K * K,
        "baselines": {
            "fla.fused_recurrent_kda": fla_spec,
            "naive_recurrent_kda_spec": lambda: lambda: naive_recurrent_kda_spec(
                q, k, v, g, beta, K**-0.5, pool, initial, cu, out),
        },
    }


def cases(device: str, quick: bool) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    T_k3 = (8192 if cuda else 1024) // (4 if quick else 1)
    out = [_prefill_case(256, TINY_HEADS, TINY_HEAD_DIM, device, "k3-tiny")]
    out.append(_prefill_case(T_k3, K3_HEADS, K3_HEAD_DIM, device, "k3"))
    out.append(_decode_case(4, TINY_HEADS, TINY_HEAD_DIM, device, "k3-tiny"))
    out.append(_decode_case(64 if cuda else 4, K3_HEADS, K3_HEAD_DIM, device, "k3"))
    if not quick:
        out.append(_spec_case(64 if cuda else 4, 5, K3_HEADS, K3_HEAD_DIM, device, "k3"))
    return out
