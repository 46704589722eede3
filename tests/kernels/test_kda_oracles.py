"""kernels/kda/naive.py tied to the public oracles: fla-core 0.6.0's naive KDA and lower-bound
gate, and transformers 5.18.0's Kimi-Linear torch functions (docs/k3-architecture.md §3.5, §10)."""

import pytest
import torch
from fla.ops.kda import gate as fla_gate
from fla.ops.kda import naive as fla_naive
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi

from k3ray.kernels.kda.naive import (
    kda_gate,
    l2norm,
    naive_chunk_kda,
    naive_recurrent_kda,
    naive_recurrent_kda_spec,
)
from k3ray.testing import assert_close


# fp32 on both sides, the same equations; only the summation order differs
FP32_RATIO = 1e-5


def _inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen))
    k = l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    A_log = torch.zeros(K)  # K3 pads A_log to head_dim; only [:H] is real
    A_log[:H] = torch.randn(H, generator=gen) * 0.5
    g = kda_gate(torch.randn(B, T, H, K, generator=gen), A_log, torch.randn(H * K, generator=gen), -5.0)
    beta = torch.rand(B, T, H, generator=gen).sigmoid()
    S0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, S0


def _unnormalised(B, T, H, K, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)


@pytest.mark.parametrize(
    "B,T,H,K,V",
    [pytest.param(*s, id="B{}-T{}-H{}-K{}-V{}".format(*s)) for s in [(2, 37, 3, 20, 24), (1, 65, 2, 32, 32)]],
)
def test_naive_recurrent_matches_fla(B, T, H, K, V):
    q, k, v, g, beta, S0 = _inputs(B, T, H, K, V)
    o, S = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=S0, output_final_state=True)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=S0, output_final_state=True)
    assert_close("o", o_ref, o, FP32_RATIO)
    assert_close("state", S_ref, S, FP32_RATIO)


def test_naive_chunk_matches_fla_chunk():
    q, k, v, g, beta, S0 = _inputs(2, 128, 2, 32, 24)
    o, S = naive_chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_ref, S_ref = fla_naive.naive_chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert_close("o", o_ref, o, FP32_RATIO)
    assert_close("state", S_ref, S, FP32_RATIO)


def test_naive_chunk_with_ragged_tail_matches_fla_recurrent():
    q, k, v, g, beta, S0 = _inputs(1, 100, 3, 20, 24, seed=3)
    o, S = naive_chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_ref, S_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    assert_close("o", o_ref, o, FP32_RATIO)
    assert_close("state", S_ref, S, FP32_RATIO)


def test_gate_matches_fla_lower_bound_gate_with_padded_a_log():
    gen = torch.Generator().manual_seed(4)
    H, K = 3, 16
    a = torch.randn(5, H, K, generator=gen) * 3
    A_log = torch.cat([torch.randn(H, generator=gen), torch.zeros(K - H)])
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(a, A_log, dt_bias, -5.0)
    g_ref = fla_gate.naive_kda_lowerbound_gate(a, A_log[:H], dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=0)  # the same elementwise fp32 ops
    assert bool((g >= -5).all() and (g <= 0).all())  # sigmoid saturates to the bounds in fp32


@pytest.mark.parametrize(
    "naive, oracle, B, T, seeds",
    [
        pytest.param(naive_recurrent_kda, "recurrent_kimi_delta_attention", 2, 29, (5, 1), id="recurrent"),
        pytest.param(naive_chunk_kda, "chunk_kimi_delta_attention", 1, 80, (6, 7), id="chunk"),
    ],
)
def test_naive_matches_transformers(naive, oracle, B, T, seeds):
    q, k, v, g, beta, S0 = _inputs(B, T, 2, 16, 16, seed=seeds[0])
    q_raw, k_raw = _unnormalised(B, T, 2, 16, seed=seeds[1])
    o, S = naive(l2norm(q_raw), l2norm(k_raw), v, g, beta, initial_state=S0, output_final_state=True)
    o_ref, S_ref = getattr(hf_kimi, oracle).__wrapped__(
        q_raw, k_raw, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert_close("o", o_ref, o, FP32_RATIO)
    assert_close("state", S_ref, S, FP32_RATIO)


def test_l2norm_matches_transformers():
    x = torch.randn(7, 3, 20, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(l2norm(x), hf_kimi.l2norm(x), rtol=1e-6, atol=1e-7)  # rsqrt vs 1/sqrt


def test_naive_spec_writes_every_prefix_state_of_the_recurrence():
    """The speculative reference equals plain recurrences over each prefix, and skips slots < 0."""
    q, k, v, g, beta, S0 = _inputs(1, 7, 2, 8, 8, seed=9)
    cu = torch.tensor([0, 3, 7])
    pool = torch.full((9, 2, 8, 8), 1e30)
    pool[0] = S0[0]
    o = naive_recurrent_kda_spec(
        q[0], k[0], v[0], g[0], beta[0], 0.5, pool, torch.tensor([0, -1]), cu,
        torch.tensor([[1, 2, 3, -1], [4, 5, -1, 6]]),
    )
    written = {1: (0, 1), 2: (0, 2), 3: (0, 3), 4: (3, 4), 5: (3, 5), 6: (3, 7)}  # slot -> (start, end)
    for slot, (s, e) in written.items():
        init = S0 if s == 0 else None
        o_ref, S_ref = naive_recurrent_kda(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], 0.5, init, output_final_state=True
        )
        assert_close(f"slot {slot}", S_ref[0], pool[slot], FP32_RATIO)
        assert_close(f"o[{e - 1}]", o_ref[0, -1], o[e - 1], FP32_RATIO)
    assert bool((pool[7:] == 1e30).all())
    assert_close("initial slot untouched", S0[0], pool[0], 0.0)
