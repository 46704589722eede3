"""CPU MXFP4 experts keep an exact dequantised copy when small; loading new weights in place
invalidates it."""

import torch

from k3ray.kernels.moe import cpu as moe_cpu
from k3ray.kernels.moe.mxfp4 import quantize_mxfp4
from k3ray.models import moe as moe_module
from k3ray.models.moe import LocalExperts


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
