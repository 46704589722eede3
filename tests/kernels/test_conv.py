"""Short conv: naive.py vs torch's grouped conv1d + SiLU, then the Triton kernel (interpreter here,
real on CUDA with the gpu marker) and the CPU path vs naive.py, over packed odd-length sequences."""

import pytest
import torch
import torch.nn.functional as F

from k3ray.kernels.conv import causal_conv1d, causal_conv1d_spec, causal_conv1d_update
from k3ray.kernels.conv.causal_conv1d_cpu import causal_conv1d_cpu, causal_conv1d_spec_cpu
from k3ray.kernels.conv.causal_conv1d_triton import causal_conv1d_spec_triton, causal_conv1d_triton
from k3ray.kernels.conv.naive import naive_causal_conv1d, naive_causal_conv1d_spec
from k3ray.testing import assert_close

# fp32 on both sides, a W-term sum per output; only the summation order differs
FP32_RATIO = 1e-6
POISON = 1e30

PREFILL_IMPLS = [pytest.param(causal_conv1d_triton, id="triton"), pytest.param(causal_conv1d_cpu, id="cpu")]
SPEC_IMPLS = [pytest.param(causal_conv1d_spec_triton, id="triton"), pytest.param(causal_conv1d_spec_cpu, id="cpu")]


def _data(lens, D, W=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lens).cumsum(0)
    x = torch.randn(int(cu[-1]), D, generator=gen).to(dtype)
    weight = torch.randn(D, W, generator=gen)
    init = torch.randn(len(lens), D, W - 1, generator=gen).to(dtype)
    return cu, x, weight, init


def test_naive_matches_torch_grouped_conv1d():
    cu, x, weight, init = _data([1, 6, 13], D=10, seed=1)
    y, final = naive_causal_conv1d(x, weight, cu, init)
    D, W = weight.shape
    for i in range(3):
        s, e = int(cu[i]), int(cu[i + 1])
        seq = torch.cat([init[i], x[s:e].T], 1)[None]  # the carried window, then the tokens
        ref = F.silu(F.conv1d(seq, weight[:, None, :], padding=W - 1, groups=D)[0, :, W - 1 : W - 1 + e - s])
        assert_close(f"y seq {i}", ref.T, y[s:e], FP32_RATIO)
        assert torch.equal(final[i], seq[0, :, -(W - 1) :])
    y0, _ = naive_causal_conv1d(x, weight, cu, None)
    ref0 = F.silu(F.conv1d(x[1:7].T[None], weight[:, None, :], padding=W - 1, groups=D)[0, :, :6])
    assert_close("zero initial window", ref0.T, y0[1:7], FP32_RATIO)


@pytest.mark.parametrize("impl", PREFILL_IMPLS)
@pytest.mark.parametrize("with_init", [True, False], ids=["init", "zeros"])
def test_prefill_matches_naive(impl, with_init, nan_empty):
    cu, x, weight, init = _data([1, 2, 37, 0, 17], D=200, seed=2)  # D spans two channel blocks
    init = init if with_init else None
    y, final = impl(x, weight, cu, init)
    y_ref, final_ref = naive_causal_conv1d(x, weight, cu, init)
    assert_close("y", y_ref, y, FP32_RATIO)
    assert_close("final window", final_ref, final, FP32_RATIO)


@pytest.mark.parametrize("impl", PREFILL_IMPLS)
def test_prefill_bf16(impl):
    cu, x, weight, init = _data([5, 20], D=48, seed=3, dtype=torch.bfloat16)
    y, final = impl(x, weight, cu, init)
    y_ref, final_ref = naive_causal_conv1d(x, weight, cu, init)
    assert y.dtype == final.dtype == torch.bfloat16
    # the interpreter truncates fp32 -> bf16 where torch (and GPUs) round to nearest: <= 1 ulp (2^-7)
    assert_close("y", y_ref, y, 1e-2)
    assert torch.equal(final_ref, final)  # the window is a copy of inputs


@pytest.mark.parametrize("impl", SPEC_IMPLS)
def test_spec_writes_window_after_every_token(impl, nan_empty):
    cu, x, weight, _ = _data([3, 1, 4], D=40, seed=4)
    gen = torch.Generator().manual_seed(5)
    pool = torch.full((14, 40, 3), POISON)
    pool[11], pool[5] = torch.randn(40, 3, generator=gen), torch.randn(40, 3, generator=gen)
    initial = torch.tensor([11, -1, 5])
    out = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1], [4, 6, 7, -1]])
    pool_ref = pool.clone()
    y = impl(x, weight, cu, pool, initial, out)
    y_ref = naive_causal_conv1d_spec(x, weight, cu, pool_ref, initial, out)
    assert_close("y", y_ref, y, FP32_RATIO)
    assert torch.equal(pool_ref, pool), "windows are copies of inputs; nothing else may change"


def test_naive_spec_windows_equal_prefix_prefill_windows():
    cu, x, weight, init = _data([4], D=6, seed=6)
    pool = torch.zeros(5, 6, 3)
    pool[4] = init[0]
    naive_causal_conv1d_spec(x, weight, cu, pool, torch.tensor([4]), torch.tensor([[0, 1, 2, 3]]))
    for j in range(4):
        _, final = naive_causal_conv1d(x[: j + 1], weight, torch.tensor([0, j + 1]), init)
        assert torch.equal(final[0], pool[j])


@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "cpu"])
def test_update_rolls_slots_in_place(on_triton, nan_empty, monkeypatch):
    import k3ray.kernels.conv.dispatch as dispatch

    if on_triton:  # the dispatcher picks Triton for CUDA tensors only; route CPU tensors to it here
        monkeypatch.setattr(dispatch, "causal_conv1d_spec_cpu", causal_conv1d_spec_triton)
    _, x, weight, _ = _data([5], D=130, seed=7)
    gen = torch.Generator().manual_seed(8)
    slots = torch.tensor([6, 0, -1, 3, 8])
    pool = torch.full((9, 130, 3), POISON)
    pool[slots[slots >= 0]] = torch.randn(4, 130, 3, generator=gen)
    pool_ref = pool.clone()
    y = causal_conv1d_update(x, weight, pool, slots)
    for i, s in enumerate(slots.tolist()):
        window = pool_ref[s : s + 1] if s >= 0 else None
        y_ref, final = naive_causal_conv1d(x[i : i + 1], weight, torch.tensor([0, 1]), window)
        assert_close(f"y[{i}]", y_ref, y[i : i + 1], FP32_RATIO)
        if s >= 0:
            pool_ref[s] = final[0]
    assert torch.equal(pool_ref, pool)


def test_dispatchers_validate():
    cu, x, weight, init = _data([3, 4], D=8, seed=9)
    y, _ = causal_conv1d(x, weight, cu, init)
    assert y.shape == x.shape
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, weight, cu, init[:, :4])
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d(x, weight, torch.tensor([0, 3, 6]), init)
    with pytest.raises(ValueError, match="out_slots"):
        causal_conv1d_spec(x, weight, cu, torch.zeros(4, 8, 3), torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="state_indices"):
        causal_conv1d_update(x[:2], weight, torch.zeros(4, 8, 3), torch.tensor([0]))


@pytest.mark.gpu
def test_triton_on_cuda_matches_cpu_path():
    cu, x, weight, init = _data([1, 300, 4097], D=3 * 1024, seed=10, dtype=torch.bfloat16)
    y_ref, final_ref = causal_conv1d_cpu(x, weight, cu, init)
    y, final = causal_conv1d(x.cuda(), weight.cuda(), cu.cuda(), init.cuda())
    assert_close("y", y_ref, y.cpu(), 4e-3)  # bf16 output rounding
    assert torch.equal(final_ref, final.cpu())
    pool = torch.randn(8, 3 * 1024, 3).to(torch.bfloat16)
    pool_ref = pool.clone()
    xs = x[:7]
    cu_s, initial, out = torch.tensor([0, 3, 7]), torch.tensor([6, -1]), torch.tensor([[0, 1, 2, -1], [3, 4, 5, -1]])
    y_ref = causal_conv1d_spec_cpu(xs, weight, cu_s, pool_ref, initial, out)
    pool = pool.cuda()
    y = causal_conv1d_spec(xs.cuda(), weight.cuda(), cu_s.cuda(), pool, initial.cuda(), out.cuda())
    assert_close("spec y", y_ref, y.cpu(), 4e-3)
    assert torch.equal(pool_ref, pool.cpu())
