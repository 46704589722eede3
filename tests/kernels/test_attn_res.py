"""AttnRes (+ the RMSNorm after it): the Triton kernel (CPU interpreter) and the CPU path vs
kernels/attn_res/naive.py, the paper's form (norm with weight, then proj) as an independent
second implementation, and the invariants of docs/k3-architecture.md §5.3."""

import pytest
import torch

from k3ray.kernels.attn_res import attn_res, attn_res_rmsnorm
from k3ray.kernels.attn_res.attn_res_cpu import attn_res_rmsnorm_cpu
from k3ray.kernels.attn_res.attn_res_triton import MANY_ROWS, attn_res_rmsnorm_triton
from k3ray.kernels.attn_res.naive import naive_attn_res, naive_attn_res_rmsnorm
from k3ray.testing import assert_close

EPS = 1e-5
# fp32: same math, different summation order; scores reach ~10 here, so their ~1e-7 relative
# rounding moves the softmax weights by up to ~1e-6 (observed up to 1e-6)
TOL_FP32 = 1e-5
# bf16: the aggregate and the normed output are each rounded once on the GPU; the interpreter
# truncates instead (triton 3.9), and the normed output inherits the aggregate's rounding
TOL_BF16 = 1.5e-2
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _inputs(T, R, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # sources of very different scales, as the bank's blocks are
    sources = torch.randn(T, R, D, generator=g) * torch.exp(torch.randn(T, R, 1, generator=g))
    proj = torch.randn(1, D, generator=g) * 0.5
    res_w = 1.0 + 0.3 * torch.randn(D, generator=g)
    out_w = 1.0 + 0.3 * torch.randn(D, generator=g)
    return [t.to(dtype) for t in (sources, proj, res_w, out_w)]


def _tol(dtype):
    return TOL_FP32 if dtype == torch.float32 else TOL_BF16


def _nan(T, D, dtype):
    return torch.full((T, D), float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R", [1, 2, 5, 9])
def test_triton_matches_naive(dtype, R):
    T, D = 7, 1100  # D spans two BLOCK_D tiles, the second one partial
    sources, proj, res_w, out_w = _inputs(T, R, D, dtype)
    ref_h, ref_y = naive_attn_res_rmsnorm(sources, proj, res_w, out_w, EPS)
    out = (_nan(T, D, dtype), _nan(T, D, dtype))
    h, y = attn_res_rmsnorm_triton(sources, proj, res_w, out_w, EPS, out=out)
    assert h.data_ptr() == out[0].data_ptr() and y.data_ptr() == out[1].data_ptr()
    assert_close("aggregated", ref_h, h, _tol(dtype))
    assert_close("normed", ref_y, y, _tol(dtype))


def test_triton_many_rows_matches_naive():
    """A prefill-sized batch takes the narrow 256-channel steps (MANY_ROWS); D = 600 ends in a partial one."""
    T, R, D = MANY_ROWS, 9, 600
    sources, proj, res_w, out_w = _inputs(T, R, D, torch.float32, seed=1)
    ref_h, ref_y = naive_attn_res_rmsnorm(sources, proj, res_w, out_w, EPS)
    h, y = attn_res_rmsnorm_triton(sources, proj, res_w, out_w, EPS)
    assert_close("aggregated", ref_h, h, TOL_FP32)
    assert_close("normed", ref_y, y, TOL_FP32)


def test_triton_without_norm_matches_naive():
    sources, proj, res_w, _ = _inputs(5, 3, 300, torch.float32)
    h, y = attn_res_rmsnorm_triton(sources, proj, res_w, None, EPS, out=(_nan(5, 300, torch.float32), None))
    assert y is None
    assert_close("aggregated", naive_attn_res(sources, proj, res_w, EPS), h, TOL_FP32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R", [1, 4, 9])
def test_cpu_path_matches_naive(dtype, R):
    sources, proj, res_w, out_w = _inputs(6, R, 515, dtype)
    ref_h, ref_y = naive_attn_res_rmsnorm(sources, proj, res_w, out_w, EPS)
    h, y = attn_res_rmsnorm_cpu(sources, proj, res_w, out_w, EPS)
    assert h.dtype == ref_h.dtype and y.dtype == ref_y.dtype
    # the CPU path rounds exactly as the reference does, so bf16 differs by at most a rare ulp
    assert_close("aggregated", ref_h, h, TOL_FP32 if dtype == torch.float32 else 5e-3)
    assert_close("normed", ref_y, y, TOL_FP32 if dtype == torch.float32 else 5e-3)


def test_dispatch_uses_cpu_path_on_cpu():
    sources, proj, res_w, out_w = _inputs(4, 3, 64, torch.float32)
    h, y = attn_res_rmsnorm(sources, proj, res_w, out_w, EPS)
    ch, cy = attn_res_rmsnorm_cpu(sources, proj, res_w, out_w, EPS)
    assert torch.equal(h, ch) and torch.equal(y, cy)
    assert torch.equal(attn_res(sources, proj, res_w, EPS), ch)


def test_dispatch_rejects_bad_arguments():
    sources, proj, res_w, out_w = _inputs(4, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="sources"):
        attn_res_rmsnorm(sources[0], proj, res_w, out_w, EPS)
    with pytest.raises(ValueError, match="R = 0"):
        attn_res_rmsnorm(sources[:, :0], proj, res_w, out_w, EPS)
    with pytest.raises(ValueError, match="D = 64"):
        attn_res_rmsnorm(sources, proj[:, :10], res_w, out_w, EPS)


# paper form and invariants -------------------------------------------------------------------
def _paper_block_attn_res(sources, proj, norm_weight, eps):
    """arXiv 2603.15031 Fig. 2 in float64: K = RMSNorm(V) with its weight, logits = proj . K,
    softmax over the depth sources, then the mix of the un-normalised V."""
    V = sources.double()
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    logits = torch.einsum("d,trd->tr", proj.reshape(-1).double(), K)
    return torch.einsum("tr,trd->td", logits.softmax(-1), V)


IMPLS = {
    "naive": lambda s, p, w, eps: naive_attn_res(s, p, w, eps),
    "cpu": lambda s, p, w, eps: attn_res_rmsnorm_cpu(s, p, w, None, eps)[0],
    "triton": lambda s, p, w, eps: attn_res_rmsnorm_triton(s, p, w, None, eps)[0],
}


@pytest.mark.parametrize("impl", IMPLS)
def test_paper_form_agrees(impl):
    sources, proj, res_w, _ = _inputs(7, 9, 200, torch.float32)
    # fp32 arithmetic against an fp64 evaluation of the paper's formula
    expected = _paper_block_attn_res(sources, proj, res_w, EPS)
    assert_close("paper form", expected, IMPLS[impl](sources, proj, res_w, EPS), TOL_FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_query_gives_uniform_mean(impl):
    sources, _, res_w, _ = _inputs(5, 6, 96, torch.float32)
    got = IMPLS[impl](sources, torch.zeros(1, 96), res_w, EPS)
    assert_close("uniform mean", sources.double().mean(1), got, 1e-6)  # fp32 mean of 6 values


@pytest.mark.parametrize("impl", IMPLS)
def test_scaling_a_source_keeps_its_score(impl):
    """Keys are RMS-normalised, so scaling source j by c leaves every p unchanged and the output
    moves by exactly (c - 1) p_j v_j: the increment per unit of (c - 1) is the same for any c."""
    sources, proj, res_w, _ = _inputs(5, 4, 128, torch.float32)
    eps = 0.0  # with eps > 0 the invariance is only approximate
    base = IMPLS[impl](sources, proj, res_w, eps).double()
    slopes = []
    for c in (3.0, 0.25):
        scaled = sources.clone()
        scaled[:, 2] *= c
        slopes.append((IMPLS[impl](scaled, proj, res_w, eps).double() - base) / (c - 1.0))
    assert_close("p_j v_j", slopes[0], slopes[1], 1e-5)  # fp32 differences of O(1) outputs
    assert slopes[0].abs().max() > 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_source_returns_itself_exactly(impl, dtype):
    sources, proj, res_w, _ = _inputs(5, 1, 130, dtype)
    assert torch.equal(IMPLS[impl](sources, proj, res_w, EPS), sources[:, 0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_normed_is_kimi_rmsnorm_of_aggregate(dtype):
    """The fused norm casts to the model dtype before the weight multiply (KimiRMSNorm)."""
    sources, proj, res_w, out_w = _inputs(4, 3, 200, dtype)
    h, y = attn_res_rmsnorm_cpu(sources, proj, res_w, out_w, EPS)
    h32 = h.float()
    expected = out_w * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    assert_close("normed", expected, y, TOL_FP32 if dtype == torch.float32 else 5e-3)


# GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_k3_shape(dtype):
    sources, proj, res_w, out_w = _inputs(33, 9, 7168, dtype)
    ref_h, ref_y = naive_attn_res_rmsnorm(sources, proj, res_w, out_w, EPS)
    h, y = attn_res_rmsnorm(*(t.cuda() for t in (sources, proj, res_w, out_w)), EPS)
    assert_close("aggregated", ref_h, h.cpu(), _tol(dtype))
    assert_close("normed", ref_y, y.cpu(), _tol(dtype))
