"""KDA fast paths vs kernels/kda/naive.py: Triton (under TRITON_INTERPRET=1 here, real on CUDA with
the gpu marker) and the vectorised CPU paths, at small odd shapes over packed sequences."""

import pytest
import torch

from k3ray.kernels.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_spec
from k3ray.kernels.kda.chunk_cpu import chunk_kda_cpu, safe_subchunk
from k3ray.kernels.kda.chunk_triton import chunk_kda_triton
from k3ray.kernels.kda.fused_recurrent_cpu import fused_recurrent_kda_cpu
from k3ray.kernels.kda.fused_recurrent_triton import fused_recurrent_kda_triton
from k3ray.kernels.kda.naive import kda_gate, l2norm, naive_chunk_kda, naive_recurrent_kda, naive_recurrent_kda_spec
from k3ray.testing import assert_close

# fp32 throughout on both sides; only the summation order (chunked vs recurrent) differs
FP32_RATIO = 1e-5
# bf16 inputs and output: the output rounding alone is ~2e-3 relative (fla's KDA tests use 0.005)
BF16_RATIO = 5e-3
POISON = 1e30

CHUNK_IMPLS = [pytest.param(chunk_kda_triton, id="triton"), pytest.param(chunk_kda_cpu, id="cpu")]
RECURRENT_IMPLS = [pytest.param(fused_recurrent_kda_triton, id="triton"), pytest.param(fused_recurrent_kda_cpu, id="cpu")]


def _inputs(T, H, K, V, seed=0, dtype=torch.float32, gate_bound=-5.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, K, generator=gen))
    k = l2norm(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, H, V, generator=gen)
    g = kda_gate(torch.randn(T, H, K, generator=gen) * 2, torch.randn(H, generator=gen) * 0.5,
                 torch.randn(H * K, generator=gen), gate_bound)
    beta = torch.rand(T, H, generator=gen).sigmoid()
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    return q, k, v, g.to(device), beta.to(device)  # gate and beta stay fp32, as the model makes them


def _reference_chunk(q, k, v, g, beta, scale, S0, cu):
    o = torch.empty(v.shape, dtype=torch.float32)
    finals = []
    for i in range(cu.numel() - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        o_i, S_i = naive_chunk_kda(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                                   scale, None if S0 is None else S0[i : i + 1], output_final_state=True)
        o[s:e] = o_i[0]
        finals.append(S_i[0])
    return o, torch.stack(finals)


@pytest.mark.parametrize("impl", CHUNK_IMPLS)
@pytest.mark.parametrize(
    "lens,H,K,V",
    [pytest.param([70, 1, 129], 2, 20, 24, id="lens70-1-129-H2-K20-V24"),
     pytest.param([63, 65], 1, 32, 32, id="lens63-65-H1-K32-V32")],
)
def test_chunk_varlen_matches_naive(impl, lens, H, K, V, nan_empty):
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta = _inputs(int(cu[-1]), H, K, V)
    S0 = torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(1))
    o, S = impl(q, k, v, g, beta, K**-0.5, S0, cu)
    o_ref, S_ref = _reference_chunk(q, k, v, g, beta, K**-0.5, S0, cu)
    assert_close("o", o_ref, o, FP32_RATIO)
    assert_close("final state", S_ref, S, FP32_RATIO)


@pytest.mark.parametrize("impl", CHUNK_IMPLS)
def test_chunk_without_initial_state_and_unbounded_gate(impl, nan_empty):
    """g down to -40 forces smaller sub-chunks in the factorised intra-chunk products."""
    cu = torch.tensor([0, 50, 77])
    q, k, v, g, beta = _inputs(77, 2, 16, 16, seed=2, gate_bound=-40.0)
    assert safe_subchunk(float(g.min()), 64) < 16
    o, S = impl(q, k, v, g, beta, 0.25, None, cu)
    o_ref, S_ref = _reference_chunk(q, k, v, g, beta, 0.25, None, cu)
    assert_close("o", o_ref, o, FP32_RATIO)
    assert_close("final state", S_ref, S, FP32_RATIO)


@pytest.mark.parametrize("impl", CHUNK_IMPLS)
def test_chunk_bf16_inputs(impl):
    cu = torch.tensor([0, 33, 100])
    q, k, v, g, beta = _inputs(100, 2, 16, 16, seed=3, dtype=torch.bfloat16)
    S0 = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(4))
    o, S = impl(q, k, v, g, beta, 0.25, S0, cu)
    o_ref, S_ref = _reference_chunk(q, k, v, g, beta, 0.25, S0, cu)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert_close("o", o_ref, o, BF16_RATIO)
    assert_close("final state", S_ref, S, FP32_RATIO)  # the state never leaves fp32


def _poisoned_pool(num_slots, H, K, V, live: dict[int, torch.Tensor]):
    pool = torch.full((num_slots, H, K, V), POISON)
    for slot, state in live.items():
        pool[slot] = state
    return pool


@pytest.mark.parametrize("impl", RECURRENT_IMPLS)
def test_decode_updates_pool_slots_in_place(impl, nan_empty):
    N, H, K, V = 5, 3, 20, 24
    q, k, v, g, beta = _inputs(N, H, K, V, seed=5)
    gen = torch.Generator().manual_seed(6)
    slots = torch.randperm(3 * N, generator=gen)[:N]
    slots[2] = -1  # a padded batch entry: zero state, nothing stored
    starts = torch.randn(N, H, K, V, generator=gen)
    pool = _poisoned_pool(3 * N, H, K, V, {int(s): starts[i] for i, s in enumerate(slots) if s >= 0})
    o = impl(q, k, v, g, beta, K**-0.5, pool, slots, torch.arange(N + 1), slots[:, None])
    for i, s in enumerate(slots.tolist()):
        init = None if s < 0 else starts[i : i + 1]
        o_ref, S_ref = naive_recurrent_kda(q[None, i : i + 1], k[None, i : i + 1], v[None, i : i + 1],
                                           g[None, i : i + 1], beta[None, i : i + 1], K**-0.5, init, True)
        assert_close(f"o[{i}]", o_ref[0, 0], o[i], FP32_RATIO)
        if s >= 0:
            assert_close(f"slot {s}", S_ref[0], pool[s], FP32_RATIO)
    untouched = torch.ones(3 * N, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert bool((pool[untouched] == POISON).all()), "a slot outside state_indices was written"


@pytest.mark.parametrize("impl", RECURRENT_IMPLS)
def test_spec_writes_state_after_every_token(impl, nan_empty):
    H, K, V = 2, 20, 24
    cu = torch.tensor([0, 3, 4, 8])
    q, k, v, g, beta = _inputs(8, H, K, V, seed=7)
    gen = torch.Generator().manual_seed(8)
    initial = torch.tensor([11, -1, 5])
    out = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1], [4, 6, 7, -1]])  # seq 2 skips its last token
    pool = _poisoned_pool(14, H, K, V, {11: torch.randn(H, K, V, generator=gen), 5: torch.randn(H, K, V, generator=gen)})
    pool_ref = pool.clone()
    o = impl(q, k, v, g, beta, 0.3, pool, initial, cu, out)
    o_ref = naive_recurrent_kda_spec(q, k, v, g, beta, 0.3, pool_ref, initial, cu, out)
    assert_close("o", o_ref, o, FP32_RATIO)
    written = [0, 1, 2, 3, 4, 6, 7]
    assert_close("written slots", pool_ref[written], pool[written], FP32_RATIO)
    assert torch.equal(pool[[5, 11]], pool_ref[[5, 11]]), "initial slots must stay as they were"
    assert bool((pool[[8, 9, 10, 12, 13]] == POISON).all())


def test_dispatchers_run_the_cpu_paths_and_validate():
    cu = torch.tensor([0, 40, 45])
    q, k, v, g, beta = _inputs(45, 2, 16, 16, seed=9)
    o, S = chunk_kda(q, k, v, g, beta, 0.25, torch.zeros(2, 2, 16, 16), cu)
    o_ref, S_ref = _reference_chunk(q, k, v, g, beta, 0.25, None, cu)
    assert_close("o", o_ref, o, FP32_RATIO)
    pool = torch.zeros(4, 2, 16, 16)
    o_dec = fused_recurrent_kda(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.25, pool, torch.tensor([3, 1]))
    assert o_dec.shape == (2, 2, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q, k, v, g, beta, 0.25, None, torch.tensor([0, 40, 44]))
    with pytest.raises(ValueError, match="g must be"):
        chunk_kda(q, k, v, g[:, :1], beta, 0.25, None, cu)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, 0.25, torch.zeros(3, 2, 16, 16), cu)
    with pytest.raises(ValueError, match="state_pool"):
        fused_recurrent_kda(q[:2], k[:2], v[:2], g[:2], beta[:2], 0.25, pool.double(), torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="out_slots"):
        fused_recurrent_kda_spec(q, k, v, g, beta, 0.25, pool, torch.tensor([0, 1]), cu, torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1000], [300, 1, 64, 700]], ids=["T1000", "varlen"])
def test_chunk_triton_on_cuda_matches_cpu_path(lens):
    cu = torch.tensor([0] + lens).cumsum(0)
    H, K, V = 4, 128, 128
    q, k, v, g, beta = _inputs(int(cu[-1]), H, K, V, seed=10, dtype=torch.bfloat16)
    S0 = torch.randn(len(lens), H, K, V, generator=torch.Generator().manual_seed(11))
    o_ref, S_ref = chunk_kda_cpu(q, k, v, g, beta, K**-0.5, S0, cu)
    o, S = chunk_kda(*(x.cuda() for x in (q, k, v, g, beta)), K**-0.5, S0.cuda(), cu.cuda())
    assert_close("o", o_ref, o.cpu(), BF16_RATIO)
    assert_close("final state", S_ref, S.cpu(), BF16_RATIO)


@pytest.mark.gpu
def test_spec_triton_on_cuda_matches_cpu_path():
    H, K, V = 8, 128, 128
    cu = torch.tensor([0, 5, 10, 12])
    q, k, v, g, beta = _inputs(12, H, K, V, seed=12, dtype=torch.bfloat16)
    pool = torch.randn(20, H, K, V, generator=torch.Generator().manual_seed(13))
    initial, out = torch.tensor([17, -1, 18]), torch.arange(15).view(3, 5)
    pool_ref = pool.clone()
    o_ref = fused_recurrent_kda_cpu(q, k, v, g, beta, K**-0.5, pool_ref, initial, cu, out)
    pool = pool.cuda()
    o = fused_recurrent_kda_spec(*(x.cuda() for x in (q, k, v, g, beta)), K**-0.5, pool, initial.cuda(), cu.cuda(), out.cuda())
    assert_close("o", o_ref, o.cpu(), BF16_RATIO)
    assert_close("pool", pool_ref, pool.cpu(), FP32_RATIO)


def test_model_spec_verification_matches_plain_prefill():
    """KimiDeltaAttention's speculative path (per-token slots) == plain prefill of each prefix."""
    from k3ray.models.forward_batch import ForwardBatch, ModelCache
    from k3ray.models.kda import KimiDeltaAttention

    torch.manual_seed(14)
    H, K, W, hidden = 2, 16, 4, 24
    layer = KimiDeltaAttention(0, hidden, H, K, K, W, -5.0, 1e-5, torch.float32)
    with torch.no_grad():
        layer.A_log.normal_(0, 0.5)
        layer.dt_bias.normal_()

    def cache():
        return ModelCache({0: torch.zeros(12, H, K, K)}, {0: torch.zeros(12, 3 * H * K, W - 1)}, {}, 16)

    def run(c, x, cu, context, slots, spec=None):
        b = ForwardBatch(torch.tensor(cu), torch.tensor(context), torch.tensor(slots), torch.zeros(2, 0), c, spec)
        with torch.no_grad():
            return layer(x, b)

    # seq 0: 5 prompt + 3 draft tokens; seq 1 restarts from nothing with 3 new tokens, so its live
    # slot (filled by the prompt run) must be ignored
    prompt, draft = torch.randn(9, hidden), torch.randn(6, hidden)
    base = cache()
    run(base, prompt, [0, 5, 9], [5, 4], [0, 1])
    spec_cache = ModelCache({0: base.kda_state[0].clone()}, {0: base.conv_state[0].clone()}, {}, 16)
    spec_slots = torch.tensor([[2, 3, 4], [5, 6, 7]])
    o_spec = run(spec_cache, draft, [0, 3, 6], [8, 3], [0, 1], spec_slots)
    assert torch.equal(spec_cache.kda_state[0][:2], base.kda_state[0][:2]), "live slots must stay untouched"
    for j in range(3):  # plain prefill of the first j + 1 draft tokens from the live state
        plain = ModelCache({0: base.kda_state[0].clone()}, {0: base.conv_state[0].clone()}, {}, 16)
        rows = [*range(0, j + 1), *range(3, 4 + j)]
        o = run(plain, draft[rows], [0, j + 1, 2 * j + 2], [6 + j, j + 1], [0, 1])
        assert_close(f"o after {j + 1}", o, o_spec[rows], FP32_RATIO)
        for i in range(2):
            slot = int(spec_slots[i, j])
            assert_close(f"kda slot {slot}", plain.kda_state[0][i], spec_cache.kda_state[0][slot], FP32_RATIO)
            assert_close(f"conv slot {slot}", plain.conv_state[0][i], spec_cache.conv_state[0][slot], FP32_RATIO)
