"""MLA attention kernels vs kernels/mla/naive.py: the Triton kernels (CPU interpreter, small odd
shapes, several sequences, NaN-filled outputs and buffers, unused cache slots poisoned with 1e30),
the vectorised CPU paths and the dispatchers."""

import pytest
import torch

from k3ray.kernels.mla import mla_decode, mla_prefill
from k3ray.kernels.mla.decode_cpu import mla_decode_cpu
from k3ray.kernels.mla.decode_triton import mla_decode_triton
from k3ray.kernels.mla.naive import naive_mla_attention, naive_paged_mla_decode
from k3ray.kernels.mla.prefill_cpu import mla_prefill_cpu, prefill_groups
from k3ray.kernels.mla.prefill_triton import mla_prefill_triton
from k3ray.testing import assert_close

POISON = 1e30
# fp32: the kernels differ from the reference only in summation order (observed ~1e-7)
TOL_FP32 = 1e-5
# bf16 outputs: one rounding is ~2^-9 relative; the interpreter truncates fp32 -> bf16 (triton 3.9)
# and flash attention rounds p to bf16 before P @ V on the GPU, so allow a few roundings
TOL_BF16 = 2e-2


def _paged_cache(lens, width, block_size, dtype, seed=0):
    """A poisoned cache with each sequence's latents in shuffled blocks, and its block table
    (padding entries point far outside the cache)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few never-used blocks
    cache = torch.full((num_blocks * block_size, width), POISON)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lens), max(blocks_per_seq) + 2), 10**8, dtype=torch.int32)
    used = 0
    for i, (n, nb) in enumerate(zip(lens, blocks_per_seq)):
        table[i, :nb] = perm[used : used + nb]
        used += nb
        pos = torch.arange(n)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        cache[slots] = torch.randn(n, width, generator=g)
    return cache.to(dtype), table, torch.tensor(lens)


def _naive_prefill(q, k, v, cu_q, cu_k, scale):
    return torch.cat([
        naive_mla_attention(q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]], scale)
        for i in range(cu_q.numel() - 1)
    ])


def _varlen(q_lens, k_lens, H, dqk, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + q_lens).cumsum(0)
    cu_k = torch.tensor([0] + k_lens).cumsum(0)
    q = torch.randn(sum(q_lens), H, dqk, generator=g).to(dtype)
    k = torch.randn(sum(k_lens), H, dqk, generator=g).to(dtype)
    v = torch.randn(sum(k_lens), H, dv, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
LENS = [1, 13, 37, 6]  # a single token, block-crossing lengths, one long enough for several tiles


def _tol(dtype):
    return TOL_FP32 if dtype == torch.float32 else TOL_BF16


# decode -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["splits1", "splits3", "splits_default"])
def test_decode_triton_matches_naive(dtype, num_splits, nan_empty):
    H, L, R, bs = 5, 20, 7, 5
    cache, table, lens = _paged_cache(LENS, L + R, bs, dtype)
    q = torch.randn(len(LENS), H, L + R).to(dtype)
    ref = naive_paged_mla_decode(q, cache, table, lens, bs, L, 0.3)
    out = torch.full((len(LENS), H, L), float("nan"), dtype=dtype)
    got = mla_decode_triton(q, cache, table, lens, bs, L, 0.3, num_splits=num_splits, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close("decode triton", ref, got, _tol(dtype))


def test_decode_triton_more_splits_than_tokens(nan_empty):
    """Splits that get no tokens must not disturb the merge."""
    H, L, R, bs = 3, 16, 8, 4
    cache, table, lens = _paged_cache([2, 5], L + R, bs, torch.float32)
    q = torch.randn(2, H, L + R)
    ref = naive_paged_mla_decode(q, cache, table, lens, bs, L, 0.2)
    assert_close("decode triton", ref, mla_decode_triton(q, cache, table, lens, bs, L, 0.2, num_splits=7), TOL_FP32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [4, None], ids=["chunk4", "one_chunk"])
def test_decode_cpu_matches_naive(dtype, chunk):
    H, L, R, bs = 5, 20, 7, 5
    cache, table, lens = _paged_cache(LENS, L + R, bs, dtype)
    q = torch.randn(len(LENS), H, L + R).to(dtype)
    ref = naive_paged_mla_decode(q, cache, table, lens, bs, L, 0.3)
    got = mla_decode_cpu(q, cache, table, lens, bs, L, 0.3, chunk=chunk)
    assert got.dtype == dtype
    assert_close("decode cpu", ref, got, _tol(dtype))


def test_decode_dispatch_uses_cpu_path_on_cpu():
    H, L, R, bs = 4, 16, 8, 4
    cache, table, lens = _paged_cache([3, 9], L + R, bs, torch.float32)
    q = torch.randn(2, H, L + R)
    expected = mla_decode_cpu(q, cache, table, lens, bs, L, 0.25)
    assert torch.equal(mla_decode(q, cache, table, lens, bs, L, 0.25), expected)


def test_decode_rejects_bad_arguments():
    cache = torch.zeros(8, 24)
    table, lens = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="cache"):
        mla_decode(torch.zeros(2, 3, 20), cache, table, lens, 4, 16, 1.0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(torch.zeros(2, 3, 24), cache, table, lens, 4, 0, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        mla_decode(torch.zeros(2, 3, 24), cache, table[:1], lens, 4, 16, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        mla_decode(torch.zeros(2, 3, 24), cache, table, lens, 0, 16, 1.0)


# prefill ----------------------------------------------------------------------------------------
PREFILL_LENS = {  # (query lens, key lens)
    "prompts": ([5, 1, 70, 3], [9, 1, 75, 40]),  # fresh, cached-prefix, multi-tile
    "mixed": ([1, 0, 9, 1, 1, 33], [30, 4, 9, 2, 61, 33]),  # decode-like rows, an empty one, prompts
}


@pytest.mark.parametrize("lens", PREFILL_LENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dqk,dv", [(27, 13), (16, 16)], ids=["dqk27_dv13", "dqk16_dv16"])
def test_prefill_triton_matches_naive(dtype, dqk, dv, lens, nan_empty):
    q_lens, k_lens = PREFILL_LENS[lens]
    q, k, v, cu_q, cu_k = _varlen(q_lens, k_lens, 3, dqk, dv, dtype)
    ref = _naive_prefill(q, k, v, cu_q, cu_k, 0.2)
    out = torch.full((q.shape[0], 3, dv), float("nan"), dtype=dtype)
    got = mla_prefill_triton(q, k, v, cu_q, cu_k, 0.2, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close("prefill triton", ref, got, _tol(dtype))


@pytest.mark.parametrize("lens", PREFILL_LENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_cpu_matches_naive(dtype, lens):
    q_lens, k_lens = PREFILL_LENS[lens]
    q, k, v, cu_q, cu_k = _varlen(q_lens, k_lens, 3, 27, 13, dtype)
    got = mla_prefill_cpu(q, k, v, cu_q, cu_k, 0.2)
    assert got.dtype == dtype
    assert_close("prefill cpu", _naive_prefill(q, k, v, cu_q, cu_k, 0.2), got, _tol(dtype))


def test_prefill_cpu_groups_bound_the_padding():
    assert prefill_groups([64, 64, 64], [64, 64, 64]) == [[0, 1, 2]]  # equal prompts: one batch
    groups = prefill_groups([1, 500, 1, 1], [900, 500, 1000, 800])
    assert sorted(map(sorted, groups)) == [[0, 2, 3], [1]]  # decode-like rows apart from the prompt


def test_prefill_dispatch_uses_cpu_path_on_cpu():
    q, k, v, cu_q, cu_k = _varlen([4, 2], [4, 7], 2, 12, 8, torch.float32)
    assert torch.equal(mla_prefill(q, k, v, cu_q, cu_k, 0.3), mla_prefill_cpu(q, k, v, cu_q, cu_k, 0.3))


def test_prefill_rejects_bad_arguments():
    q, k, v, cu_q, cu_k = _varlen([4, 2], [4, 7], 2, 12, 8, torch.float32)
    with pytest.raises(ValueError, match="expected q"):
        mla_prefill(q, k[..., :5], v, cu_q, cu_k, 0.3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mla_prefill(q, k, v, cu_q, cu_k[:2], 0.3)


# GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_gpu_k3_heads_long_context(dtype):
    H, L, R, bs = 96, 512, 64, 64
    cache, table, lens = _paged_cache([3000, 17, 1025], L + R, bs, dtype)
    q = torch.randn(3, H, L + R).to(dtype)
    ref = naive_paged_mla_decode(q, cache, table, lens, bs, L, 192**-0.5)
    got = mla_decode(q.cuda(), cache.cuda(), table.cuda(), lens.cuda(), bs, L, 192**-0.5)
    assert_close("decode gpu", ref, got.cpu(), _tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_gpu_k3_heads(dtype):
    q, k, v, cu_q, cu_k = _varlen([300, 1, 77], [300, 40, 500], 8, 192, 128, dtype)
    ref = _naive_prefill(q, k, v, cu_q, cu_k, 192**-0.5)
    got = mla_prefill(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(), 192**-0.5)
    assert_close("prefill gpu", ref, got.cpu(), _tol(dtype))
