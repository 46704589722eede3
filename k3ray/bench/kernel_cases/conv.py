"""Benchmark cases for the short-conv entry points (collected by `k3ray bench kernels`).
K3 runs the q | k | v convs as one over 3 * 96 * 128 = 36864 channels, width 4.
Baselines (--compare): fla-core's short conv (`causal_conv1d`, `causal_conv1d_update`; CUDA) and
naive.py. fla keeps a width-W window (ours W - 1) and has no state pool for decode."""

from __future__ import annotations

from typing import Any

import torch

from k3ray.bench.kernel_cases.baselines import fla_function
from k3ray.kernels.conv.dispatch import causal_conv1d, causal_conv1d_spec, causal_conv1d_update
from k3ray.kernels.conv.naive import naive_causal_conv1d, naive_causal_conv1d_spec

K3_CHANNELS, TINY_CHANNELS, WIDTH = 3 * 96 * 128, 3 * 2 * 32, 4


def _data(T: int, D: int, device: str, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    weight = torch.randn(D, WIDTH, generator=gen).to(device)
    return x, weight


def _prefill_case(T: int, D: int, device: str, label: str) -> dict[str, Any]:
    x, weight = _data(T, D, device)
    init = torch.zeros(1, D, WIDTH - 1, device=device, dtype=x.dtype)
    cu = torch.tensor([0, T], device=device)
    e = x.element_size()

    def fla_prefill():  # zero initial window, as ours; final window returned; weights in x's dtype, as fla's layer
        fn = fla_function("fla.modules.causal_conv1d", "causal_conv1d", device)
        w = weight.to(x.dtype)
        return lambda: fn(x[None], w, output_final_state=True, activation="silu", cu_seqlens=cu.long())

    return {
        "op": "conv_prefill",
        "shape": f"{label} T={T} D={D} W={WIDTH}",
        "fn": lambda: causal_conv1d(x, weight, cu, init),
        "bytes": 2 * T * D * e + D * WIDTH * 4 + 2 * D * (WIDTH - 1) * e,
        "flops": T * D * (2 * WIDTH + 4),  # the taps plus SiLU
        "baselines": {"fla.causal_conv1d": fla_prefill,
                      "naive_causal_conv1d": lambda: lambda: naive_causal_conv1d(x, weight, cu, init)},
    }


def _decode_case(N: int, D: int, device: str, label: str) -> dict[str, Any]:
    x, weight = _data(N, D, device)
    pool = torch.zeros(2 * N, D, WIDTH - 1, device=device, dtype=x.dtype)
    slots = torch.arange(0, 2 * N, 2, device=device)
    e = x.element_size()
    one_token_each = torch.arange(N + 1, device=device)

    def fla_decode():  # a dense [N, D, W] window cache: fla has no slot indices
        fn = fla_function("fla.modules.causal_conv1d.ops", "causal_conv1d_update", device)
        cache = torch.zeros(N, D, WIDTH, device=device, dtype=x.dtype)
        w = weight.to(x.dtype)
        return lambda: fn(x, cache, weight=w, activation="silu")

    def naive_decode():
        _, pool[slots] = naive_causal_conv1d(x, weight, one_token_each, pool[slots])

    return {
        "op": "conv_decode",
        "shape": f"{label} N={N} D={D} W={WIDTH}",
        "fn": lambda: causal_conv1d_update(x, weight, pool, slots),
        "bytes": 2 * N * D * e + D * WIDTH * 4 + 2 * N * D * (WIDTH - 1) * e,
        "flops": N * D * (2 * WIDTH + 4),
        "baselines": {"fla.causal_conv1d_update": fla_decode, "naive_causal_conv1d": lambda: naive_decode},
    }


def _spec_case(N: int, q_len: int, D: int, device: str, label: str) -> dict[str, Any]:
    T = N * q_len
    x, weight = _data(T, D, device)
    pool = torch.zeros(N * (q_len + 1), D, WIDTH - 1, device=device, dtype=x.dtype)
    initial = torch.arange(N, device=device)
    out = N + torch.arange(T, device=device).view(N, q_len)
    cu = torch.arange(0, T + 1, q_len, device=device)
    e = x.element_size()
    return {
        "op": "conv_spec_verify",
        "shape": f"{label} N={N} q_len={q_len} D={D} W={WIDTH}",
        "fn": lambda: causal_conv1d_spec(x, weight, cu, pool, initial, out),
        "bytes": 2 * T * D * e + D * WIDTH * 4 + (N + T) * D * (WIDTH - 1) * e,
        "flops": T * D * (2 * WIDTH + 4),
        "baselines": {"naive_causal_conv1d_spec": lambda: lambda: naive_causal_conv1d_spec(
            x, weight, cu, pool, initial, out)},
    }


def cases(device: str, quick: bool) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    T_k3 = (8192 if cuda else 1024) // (4 if quick else 1)
    out = [
        _prefill_case(256, TINY_CHANNELS, device, "k3-tiny"),
        _prefill_case(T_k3, K3_CHANNELS, device, "k3"),
        _decode_case(64 if cuda else 4, K3_CHANNELS, device, "k3"),
    ]
    if not quick:
        out.append(_spec_case(64 if cuda else 4, 5, K3_CHANNELS, device, "k3"))
    return out
