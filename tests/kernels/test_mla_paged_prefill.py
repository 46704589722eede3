"""Absorbed MLA prefill over a paged cache (key-chunked PyTorch and CPU flash) == the naive
absorbed form."""

import pytest
import torch

from k3ray.kernels.mla import mla_prefill_paged
from k3ray.kernels.mla.naive import absorbed_mla_attention
from k3ray.kernels.mla.prefill_paged_chunked import mla_prefill_paged_chunked
from k3ray.kernels.mla.prefill_paged_cpu import mla_prefill_paged_cpu


@pytest.mark.parametrize("prior, tq, chunk", [(0, 7, 3), (13, 5, 4), (29, 1, 8), (40, 17, 1000)])
def test_paged_prefill_matches_naive(prior, tq, chunk):
    gen = torch.Generator().manual_seed(prior + tq)
    H, L, R, bs = 3, 16, 8, 4
    total = prior + tq
    n_blocks = (total + bs - 1) // bs
    cache = torch.full((64, L + R), 1e30, dtype=torch.float64)  # unused slots poisoned
    table = torch.randperm(16, generator=gen)[:n_blocks]
    lat = torch.randn(total, L + R, generator=gen, dtype=torch.float64)
    pos = torch.arange(total)
    cache[table[pos // bs] * bs + pos % bs] = lat
    q = torch.randn(tq, H, L + R, generator=gen, dtype=torch.float64)
    ref = absorbed_mla_attention(q, lat, L, 0.2)
    for impl in (mla_prefill_paged_chunked, mla_prefill_paged_cpu):
        out = impl(q, cache, table, prior, bs, L, 0.2, chunk=chunk)
        assert (out - ref).abs().max().item() <= 1e-12  # fp64: only summation order differs
    assert torch.allclose(mla_prefill_paged(q, cache, table, prior, bs, L, 0.2), ref, atol=1e-12, rtol=0)


def test_paged_prefill_rejects_bad_shapes():
    with pytest.raises(ValueError, match="q_latent"):
        mla_prefill_paged(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(1), 0, 4, 2, 1.0)
    with pytest.raises(ValueError, match="prior_len"):
        mla_prefill_paged(torch.zeros(2, 1, 3), torch.zeros(4, 3), torch.zeros(1), -1, 4, 2, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_prefill_cpu_half_operands_stay_within_their_roundings(dtype):
    """Half-precision q and cache go to the flash calls as they are (fp32 sums inside). Against the
    fp64 attention of the same rounded values, the error is a few roundings of the output's size:
    probabilities, each chunk's output and the result are each rounded once (unit roundoff u), so
    |err| <= 3u max|v| (plus fp32 noise); fp32 math on the same inputs rounds only the result."""
    gen = torch.Generator().manual_seed(5)
    H, L, R, bs, prior, tq = 4, 64, 16, 16, 300, 40
    total = prior + tq
    lat = torch.randn(total, L + R, generator=gen).to(dtype)
    q = torch.randn(tq, H, L + R, generator=gen).to(dtype)
    table = torch.randperm(total // bs + 1, generator=gen)
    cache = torch.zeros(len(table) * bs, L + R, dtype=dtype)
    pos = torch.arange(total)
    cache[table[pos // bs] * bs + pos % bs] = lat
    ref = absorbed_mla_attention(q.double(), lat.double(), L, 0.1)
    u = torch.finfo(dtype).eps / 2
    out = mla_prefill_paged_cpu(q, cache, table, prior, bs, L, 0.1, chunk=128)  # three prior chunks
    assert out.dtype == dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= 3 * u * lat[:, :L].abs().max().item()
    fp32 = mla_prefill_paged_cpu(q.float(), cache.float(), table, prior, bs, L, 0.1, chunk=128)
    assert (fp32.double() - ref).abs().max().item() <= 1e-5  # the fp32 path: fp32 noise only
