"""CPU MXFP4 experts keep an exact dequantised copy when small; loading new weights in place
invalidates it."""

import pytest
import torch

from k3ray.kernels.moe import cpu as moe_cpu
from k3ray.kernels.moe.mxfp4 import quantize_mxfp4
from k3ray.models import moe as moe_module
from k3ray.models.moe import LocalExperts
from k3ray.testing import assert_close


def fill(experts: LocalExperts, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in ("w1", "w3", "w2"):
        packed, scale = experts.weights(name)
        for e in range(experts.count):
            p, s = quantize_mxfp4(torch.randn(packed.shape[1], packed.shape[2] * 2, generator=gen))
            packed[e].copy_(p)  # in place, as the checkpoint loader writes
            scale[e].copy_(s)


def run(experts, h, ids, weights, monkeypatch, cache_bytes):
    monkeypatch.setattr(moe_module, "DEQUANTIZED_CACHE_BYTES", cache_bytes)
    return experts(h, ids, weights)


def test_dequantized_copy_is_exact_and_follows_reloads(monkeypatch):
    monkeypatch.setattr(moe_cpu, "GATHER_MAX_ELEMENTS", 0)  # the same grouped GEMMs either way: bit-exact
    monkeypatch.setattr(moe_cpu, "EVERY_EXPERT_MAX_MACS", 0)
    experts = LocalExperts(2, 4, 64, 32, "mxfp4", 4.0, 25.0, torch.float32)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(9, 64, generator=gen)
    ids = torch.randint(0, 8, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    fill(experts, 1)
    packed = run(experts, h, ids, weights, monkeypatch, 0)
    assert not experts._dequantized
    cached = run(experts, h, ids, weights, monkeypatch, 1 << 30)
    assert len(experts._dequantized) == 3 and torch.equal(cached, packed)
    fill(experts, 2)  # new weights, same tensors
    reloaded = run(experts, h, ids, weights, monkeypatch, 1 << 30)
    assert torch.equal(reloaded, run(experts, h, ids, weights, monkeypatch, 0))
    assert not torch.equal(reloaded, packed) and len(experts._dequantized) == 3
    bf16 = run(experts, h.bfloat16(), ids, weights, monkeypatch, 1 << 30)
    assert torch.equal(bf16, run(experts, h.bfloat16(), ids, weights, monkeypatch, 0))


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_every_expert_weights_follow_reloads(fmt, monkeypatch):
    """The fused operands of the every-expert path are rebuilt when the weights are reloaded in
    place (MXFP4: a new dequantised copy; dense: the parameters' version counters)."""
    experts = LocalExperts(2, 4, 64, 32, fmt, 4.0, 25.0, torch.float32)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 64, generator=gen)
    ids = torch.randint(0, 8, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)

    def load(seed: int) -> None:
        if fmt == "mxfp4":
            fill(experts, seed)
        else:
            g = torch.Generator().manual_seed(seed)
            for name in ("w1", "w3", "w2"):
                with torch.no_grad():
                    getattr(experts, name).copy_(torch.randn(getattr(experts, name).shape, generator=g))

    def grouped() -> torch.Tensor:
        monkeypatch.setattr(moe_cpu, "EVERY_EXPERT_MAX_MACS", 0)
        monkeypatch.setattr(moe_cpu, "GATHER_MAX_ELEMENTS", 0)
        out = experts(h, ids, weights)
        monkeypatch.setattr(moe_cpu, "EVERY_EXPERT_MAX_MACS", 1 << 30)
        return out

    monkeypatch.setattr(moe_cpu, "EVERY_EXPERT_MAX_MACS", 1 << 30)
    for seed in (1, 2):
        load(seed)
        with torch.inference_mode():  # as the executors run: dequantised copies are inference tensors
            got = experts(h, ids, weights)
        assert experts._fused is not None
        assert_close(f"every expert after load {seed}", grouped(), got, 1e-6)
