"""MoE kernels vs kernels/moe/naive.py: the Triton expert selection and grouped SiTU-GLU expert
GEMMs (CPU interpreter; dense and MXFP4 weights; local expert ranges), the grouped CPU path, and the
SiTU limits of docs/k3-architecture.md §6.2."""

import pytest
import torch
import torch.nn.functional as F

from k3ray.kernels.moe import experts_cpu as moe_cpu
from k3ray.kernels.moe import moe_experts, select_experts, situ_glu
from k3ray.kernels.moe.experts_cpu import moe_experts_cpu
from k3ray.kernels.moe.experts_triton import moe_experts_triton
from k3ray.kernels.moe.mxfp4 import GROUP
from k3ray.kernels.moe.naive import naive_moe_experts, naive_select_experts
from k3ray.kernels.moe.select_experts_triton import select_experts_triton
from k3ray.testing import assert_close

BETA, LINEAR_BETA = 4.0, 25.0
# fp32: the same GEMMs in another summation order (observed ~5e-7)
TOL_FP32 = 1e-5
# bf16: gate, up, activation and expert output are each rounded to bf16 as in the reference; the
# interpreter truncates instead of rounding (triton 3.9), so ~4 one-sided roundings (~1e-2 observed)
TOL_BF16 = 3e-2
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _routing(T, E_total, k, seed=0):
    g = _gen(seed)
    ids = torch.stack([torch.randperm(E_total, generator=g)[:k] for _ in range(T)])
    return ids, torch.rand(T, k, generator=g)


def _dense(E, out, inp, scale, g):
    return torch.randn(E, out, inp, generator=g) * scale


def _mxfp4(E, out, inp, g):
    """Random packed bytes (every E2M1 code, both signs) and E8M0 scales around 2^-3."""
    packed = torch.randint(0, 256, (E, out, inp // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(122, 126, (E, out, inp // GROUP), dtype=torch.uint8, generator=g)
    return packed, scale


def _experts(fmt, E, I, Dl, dtype, seed=0):
    g = _gen(seed)
    if fmt == "mxfp4":
        return _mxfp4(E, I, Dl, g), _mxfp4(E, I, Dl, g), _mxfp4(E, Dl, I, g)
    # gate pre-activations of a few units, so SiTU's tanh saturates for some of them
    return tuple(w.to(dtype) for w in (_dense(E, I, Dl, 0.4, g), _dense(E, I, Dl, 0.4, g), _dense(E, Dl, I, 0.2, g)))


def _tol(dtype):
    return TOL_FP32 if dtype == torch.float32 else TOL_BF16


# routing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalize,scaling", [(True, 1.0), (False, 2.5)], ids=["renorm", "raw_scaled"])
def test_select_experts_triton_matches_naive(renormalize, scaling, nan_empty):
    g = _gen(1)
    logits, bias = torch.randn(7, 37, generator=g) * 3, torch.randn(37, generator=g) * 0.2
    w_ref, ids_ref = naive_select_experts(logits, bias, 5, renormalize, scaling)
    out = (torch.full((7, 5), float("nan")), torch.full((7, 5), -1, dtype=torch.long))
    w, ids = select_experts_triton(logits, bias, 5, renormalize, scaling, out=out)
    assert torch.equal(ids, ids_ref)  # same experts in the same (descending biased score) order
    assert_close("route weights", w_ref, w, 1e-6)  # fp32 sigmoid and division


def test_select_experts_dispatch_on_cpu_is_the_reference():
    logits, bias = torch.randn(5, 16), torch.randn(16)
    w, ids = select_experts(logits, bias, 4)
    w_ref, ids_ref = naive_select_experts(logits, bias, 4)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def test_select_experts_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(3, 8), torch.zeros(8), 9)
    with pytest.raises(ValueError, match="bias"):
        select_experts(torch.randn(3, 8), torch.zeros(7), 2)


# experts ------------------------------------------------------------------------------------
FMTS = [pytest.param("dense", id="dense"), pytest.param("mxfp4", id="mxfp4")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("expert_offset", [0, 3], ids=["all_local", "offset3"])
def test_experts_triton_matches_naive(fmt, dtype, expert_offset, nan_empty):
    """11 tokens, top-3 over 9 experts of which 5 are held here: at offset 3 some ids lie below
    and some above the local range and must contribute nothing."""
    T, k, E = 11, 3, 5
    Dl, I = (64, 96) if fmt == "mxfp4" else (45, 37)  # MXFP4 needs multiples of 32; dense gets odd dims
    h = torch.randn(T, Dl, generator=_gen(2)).to(dtype)
    ids, weights = _routing(T, 9, k)
    w1, w3, w2 = _experts(fmt, E, I, Dl, dtype)
    ref = naive_moe_experts(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA, expert_offset)
    got = moe_experts_triton(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA, expert_offset)
    assert got.dtype == torch.float32
    assert_close("experts triton", ref, got, _tol(dtype))


def test_experts_triton_many_tokens_per_expert(nan_empty):
    """Enough rows that an expert spans several BLOCK_M tiles (the prefill tiling)."""
    T, k, E, Dl, I = 130, 2, 3, 64, 64
    h = torch.randn(T, Dl, generator=_gen(3))
    ids, weights = _routing(T, E, k)
    w1, w3, w2 = _experts("mxfp4", E, I, Dl, torch.float32)
    ref = naive_moe_experts(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA)
    assert_close("experts triton", ref, moe_experts_triton(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA), TOL_FP32)


def test_experts_triton_no_local_tokens():
    h = torch.randn(4, 32)
    ids, weights = _routing(4, 6, 2)
    w1, w3, w2 = _experts("mxfp4", 2, 32, 32, torch.float32)
    got = moe_experts_triton(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA, expert_offset=6)
    assert torch.equal(got, torch.zeros(4, 32))


@pytest.mark.parametrize("path", ["grouped", "gathered", "every"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("expert_offset", [0, 3], ids=["all_local", "offset3"])
def test_experts_cpu_matches_naive(fmt, dtype, expert_offset, path, monkeypatch):
    monkeypatch.setattr(moe_cpu, "GATHER_MAX_ELEMENTS", 1 << 30 if path == "gathered" else 0)
    monkeypatch.setattr(moe_cpu, "EVERY_EXPERT_MAX_MACS", 1 << 30 if path == "every" else 0)  # dense fp32 only
    T, k, E = 13, 3, 5
    Dl, I = (64, 96) if fmt == "mxfp4" else (45, 37)
    h = torch.randn(T, Dl, generator=_gen(4)).to(dtype)
    ids, weights = _routing(T, 9, k, seed=5)
    w1, w3, w2 = _experts(fmt, E, I, Dl, dtype, seed=6)
    ref = naive_moe_experts(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA, expert_offset)
    got = moe_experts_cpu(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA, expert_offset)
    # grouped / gathered: the same per-expert GEMMs on the same rows, combined in the same order;
    # every: the same products through other GEMM kernels, a row's k = 3 outputs summed in another order
    assert_close("experts cpu", ref, got, 1e-6)


@pytest.mark.parametrize("path", ["gathered", "every"])
def test_experts_cpu_no_local_tokens(path, monkeypatch):
    monkeypatch.setattr(moe_cpu, "EVERY_EXPERT_MAX_MACS", 1 << 30 if path == "every" else 0)
    h = torch.randn(4, 32)
    ids, weights = _routing(4, 6, 2)
    w1, w3, w2 = _experts("dense", 2, 32, 32, torch.float32)
    got = moe_experts_cpu(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA, expert_offset=6)
    assert torch.equal(got, torch.zeros(4, 32))


def test_experts_dispatch_uses_cpu_path_on_cpu():
    h = torch.randn(6, 32)
    ids, weights = _routing(6, 4, 2)
    w = _experts("mxfp4", 4, 32, 32, torch.float32)
    assert torch.equal(moe_experts(h, ids, weights, *w, BETA, LINEAR_BETA),
                       moe_experts_cpu(h, ids, weights, *w, BETA, LINEAR_BETA))


def test_experts_rejects_bad_arguments():
    h = torch.randn(6, 32)
    ids, weights = _routing(6, 4, 2)
    w1, w3, w2 = _experts("dense", 4, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="w2"):
        moe_experts(h, ids, weights, w1, w3, w1, BETA, LINEAR_BETA)
    with pytest.raises(ValueError, match="ids and weights"):
        moe_experts(h, ids, weights[:, :1], w1, w3, w2, BETA, LINEAR_BETA)
    packed, scale = _experts("mxfp4", 4, 32, 32, torch.float32)[0]
    with pytest.raises(ValueError, match="scale"):
        moe_experts(h, ids, weights, (packed, scale[..., :0]), (packed, scale), (packed, scale), BETA, LINEAR_BETA)


# SiTU -----------------------------------------------------------------------------------------
def test_situ_large_beta_is_silu_glu():
    g, u = torch.randn(200) * 4, torch.randn(200) * 4
    # beta * tanh(x / beta) = x (1 - x^2 / (3 beta^2) + ...): relative deviation ~1e-11 at beta = 1e5
    assert_close("silu(g) * u", F.silu(g) * u, situ_glu(g, u, 1e5, 1e5), 1e-6)


def test_situ_large_linear_beta_leaves_up_uncapped():
    g, u = torch.randn(200) * 4, torch.randn(200) * 4
    expected = BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * u
    assert_close("uncapped up", expected, situ_glu(g, u, BETA, 1e5), 1e-6)


def test_situ_is_bounded_by_beta_times_linear_beta():
    g, u = torch.randn(10_000) * 1e3, torch.randn(10_000) * 1e3
    out = situ_glu(g, u, BETA, LINEAR_BETA)
    assert out.abs().max() <= BETA * LINEAR_BETA
    assert out.abs().max() > 0.9 * BETA * LINEAR_BETA  # the bound is reached in the saturated corner


def test_triton_situ_saturates_like_naive():
    """Huge pre-activations through the Triton expert kernel: its exp-based tanh and sigmoid
    must saturate without overflow to NaN, matching the reference."""
    T, E, Dl, I = 5, 2, 32, 32
    h = torch.randn(T, Dl, generator=_gen(7)) * 50
    ids, weights = _routing(T, E, 1)
    w1, w3, w2 = _experts("dense", E, I, Dl, torch.float32)
    ref = naive_moe_experts(h, ids, weights, w1, w3, w2, BETA, 2.0)
    assert_close("saturated experts", ref, moe_experts_triton(h, ids, weights, w1, w3, w2, BETA, 2.0), TOL_FP32)


# GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_select_experts_gpu_k3_shape():
    logits, bias = torch.randn(64, 896) * 2, torch.randn(896) * 0.05
    w_ref, ids_ref = naive_select_experts(logits, bias, 16)
    w, ids = select_experts(logits.cuda(), bias.cuda(), 16)
    assert torch.equal(ids.cpu(), ids_ref)
    assert_close("route gpu", w_ref, w.cpu(), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 300], ids=["decode", "prefill"])
def test_experts_gpu_k3_widths_mxfp4(T):
    E, k, Dl, I = 8, 4, 3584, 3072
    h = torch.randn(T, Dl, generator=_gen(8)).bfloat16()
    ids, weights = _routing(T, 12, k)
    w1, w3, w2 = _experts("mxfp4", E, I, Dl, torch.bfloat16)
    ref = naive_moe_experts(h, ids, weights, w1, w3, w2, BETA, LINEAR_BETA, 2)
    cuda = lambda w: tuple(t.cuda() for t in w)  # noqa: E731
    got = moe_experts(h.cuda(), ids.cuda(), weights.cuda(), cuda(w1), cuda(w3), cuda(w2), BETA, LINEAR_BETA, 2)
    assert_close("experts gpu", ref, got.cpu(), 1e-2)  # bf16 GEMMs with long fp32 accumulations
