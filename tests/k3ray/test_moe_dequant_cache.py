"""CPU MXFP4 experts keep an exact dequantised copy when small; loading new weights in place
invalidates it."""

import pytest
import torch

from k3ray.kernels.moe import experts_cpu as moe_cpu
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
    experts._cpu_cache.clear()  # the limit is read when the CPU operands are built
    return experts(h, ids, weights)


def cpu_weights(experts, dtype=torch.float32):
    return experts._cpu_cache[dtype].weights


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
    assert all(isinstance(w, tuple) for w in cpu_weights(experts))  # too big for the limit: kept packed
    cached = run(experts, h, ids, weights, monkeypatch, 1 << 30)
    dense = cpu_weights(experts)
    assert all(isinstance(w, torch.Tensor) for w in dense) and torch.equal(cached, packed)
    assert experts(h, ids, weights) is not None and cpu_weights(experts) is dense  # kept between calls
    fill(experts, 2)  # new weights, same tensors: their version counters move
    reloaded = experts(h, ids, weights)
    assert cpu_weights(experts)[0] is not dense[0]
    assert torch.equal(reloaded, run(experts, h, ids, weights, monkeypatch, 0))
    assert not torch.equal(reloaded, packed)
    bf16 = run(experts, h.bfloat16(), ids, weights, monkeypatch, 1 << 30)
    assert torch.equal(bf16, run(experts, h.bfloat16(), ids, weights, monkeypatch, 0))
    assert set(experts._cpu_cache) == {torch.bfloat16}  # cleared by run(); one entry per activation dtype


def test_replaced_weight_tensors_invalidate_the_copy(monkeypatch):
    """A buffer replaced by a new tensor (not written in place) is noticed too."""
    experts = LocalExperts(0, 2, 64, 32, "mxfp4", 4.0, 25.0, torch.float32)
    fill(experts, 1)
    h, ids, weights = torch.randn(3, 64), torch.tensor([[0, 1]] * 3), torch.rand(3, 2)
    before = experts(h, ids, weights)
    experts.w2_packed = experts.w2_packed.flip(0).clone()  # same version counter value, new tensor
    experts.w2_scale = experts.w2_scale.flip(0).clone()
    after = experts(h, ids, weights)
    experts._cpu_cache.clear()
    assert torch.equal(after, experts(h, ids, weights)) and not torch.equal(after, before)


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
        assert experts._cpu_cache[torch.float32].fused is not None
        assert_close(f"every expert after load {seed}", grouped(), got, 1e-6)


def test_parameter_data_swapped_as_module_to_does_invalidates_the_fusion(monkeypatch):
    """Module.to assigns a parameter's .data (same object, same version counter, new memory): the
    every-expert operands built from the old values are not reused."""
    monkeypatch.setattr(moe_cpu, "EVERY_EXPERT_MAX_MACS", 1 << 30)
    experts = LocalExperts(0, 2, 64, 32, "bf16", 4.0, 25.0, torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            getattr(experts, name).copy_(torch.randn(getattr(experts, name).shape, generator=gen))
    h, ids, weights = torch.randn(3, 64, generator=gen), torch.tensor([[0, 1]] * 3), torch.rand(3, 2, generator=gen)
    before = experts(h, ids, weights)
    w1 = experts.w1
    version = w1._version
    w1.data = torch.randn(w1.shape, generator=gen)
    assert experts.w1 is w1 and w1._version == version
    after = experts(h, ids, weights)
    experts._cpu_cache.clear()
    assert torch.equal(after, experts(h, ids, weights)) and not torch.equal(after, before)
    experts.double().float()  # new memory twice over, values kept
    assert torch.equal(experts(h, ids, weights), after)
