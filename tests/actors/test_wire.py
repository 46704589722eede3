"""Tensors cross actor calls as one wire bundle (k3ray.actors.pipeline.wire): bit-exact for every dtype
the model uses, one bytes object for small payloads, (header, numpy) for large ones."""

import pickle

import numpy as np
import pytest
import torch
from ray import cloudpickle as ray_cloudpickle

from k3ray.actors.pipeline import wire
from k3ray.actors.pipeline.protocol import WirePlan
from k3ray.actors.pipeline.wire import pack, pack_raw, unpack, unpack_raw, unpack_tagged
from k3ray.engine.execution.plan import BatchPlan

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("large", [False, True])
def test_bundle_round_trip_is_bit_exact(large, monkeypatch):
    if large:
        monkeypatch.setattr(wire, "SMALL_PAYLOAD_BYTES", 0)
    gen = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(5, 3, generator=gen) * 100).to(d) for d in DTYPES]  # odd byte sizes: alignment
    tensors += [None, torch.zeros(0, 4), torch.tensor(7)]
    bundle = pack(*tensors)
    assert isinstance(bundle[1], np.ndarray) if large else isinstance(bundle, bytes)
    back = unpack(pickle.loads(pickle.dumps(bundle)))
    assert len(back) == len(tensors)
    for t, b in zip(tensors, back):
        if t is None:
            assert b is None
            continue
        assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t)
    back[0].add_(1)  # writable, independent of the sender and of the other tensors
    assert torch.equal(unpack(bundle)[0], tensors[0]) and torch.equal(back[1], tensors[1])


@pytest.mark.parametrize("large", [False, True])
def test_a_tag_travels_in_the_header(large, monkeypatch):
    if large:
        monkeypatch.setattr(wire, "SMALL_PAYLOAD_BYTES", 0)
    tensors = (torch.randn(3, 4), torch.arange(6).view(3, 2))
    tag, back = unpack_tagged(pickle.loads(pickle.dumps(pack(*tensors, tag=7))))
    assert tag == 7 and all(torch.equal(a, b) for a, b in zip(tensors, back))
    assert unpack_tagged(pack(*tensors))[0] is None


@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_tensor_round_trip(large, dtype, monkeypatch):
    """pack_raw: the bytes alone (the receiver knows dtype and shape), a numpy array when large."""
    if large:
        monkeypatch.setattr(wire, "SMALL_PAYLOAD_BYTES", 0)
    t = (torch.randn(6, 5) * 100).to(dtype)
    raw = pack_raw(t.T)  # not contiguous
    assert isinstance(raw, np.ndarray) if large else raw == t.T.contiguous().view(torch.uint8).numpy().tobytes()
    back = unpack_raw(pickle.loads(pickle.dumps(raw)), dtype, (5, 6))
    assert back.dtype == dtype and torch.equal(back, t.T)
    back.add_(1)  # writable, independent of the sender
    assert torch.equal(unpack_raw(raw, dtype, (5, 6)), t.T)
    assert unpack_raw(pack_raw(torch.zeros(0, 3)), torch.float32, (0, 3)).shape == (0, 3)


def test_small_bundles_are_one_bytes_object():
    bundle = pack(torch.ones(2, 2), None)
    size = int.from_bytes(bundle[:4], "little")
    assert pickle.loads(bundle[4 : 4 + size]) == (None, (("float32", (2, 2), 0), None))
    base = -(-(4 + size) // wire.ALIGN) * wire.ALIGN
    assert bundle[base:] == torch.ones(4).numpy().tobytes()


@pytest.mark.parametrize("pickler", [pickle, ray_cloudpickle], ids=["pickle", "ray"])
def test_batch_plans_cross_as_one_bundle_encoded_at_the_boundary(pickler):
    """The runner sends a BatchPlan to the stages as a WirePlan: one wire bundle, no pickled tensor,
    decoded back field for field. Importing the protocol changes nothing else: a BatchPlan pickled
    anywhere else is still a plain pickle (no process-wide copyreg hook)."""
    plan = BatchPlan(torch.arange(5), torch.tensor([0, 5]), torch.tensor([5]), torch.tensor([1]),
                     torch.arange(4)[None], logits_indices=torch.tensor([4]),
                     mm_embeds=torch.arange(6.0).view(2, 3).bfloat16(), mm_positions=torch.tensor([1, 2]))
    data = pickler.dumps(WirePlan.encode(plan))
    assert b"torch" not in data  # one bundle, no pickled tensor
    back = pickler.loads(data).decode()
    assert isinstance(back, BatchPlan)
    for name in ("input_ids", "cu_seqlens", "context_lens", "state_slots", "block_tables", "logits_indices",
                 "mm_positions", "mm_embeds"):
        assert torch.equal(getattr(back, name), getattr(plan, name)), name
    assert back.spec_state_slots is None
    assert b"torch" in pickler.dumps(plan)  # the engine's type pickles as itself


@pytest.mark.parametrize("large", [False, True])
def test_sum_raw_adds_partials_in_order(large, monkeypatch):
    """sum_raw == unpack_raw of the first + each further one in turn, bit for bit, as a new tensor."""
    if large:
        monkeypatch.setattr(wire, "SMALL_PAYLOAD_BYTES", 0)
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(4, 3, generator=gen) * 10 ** i for i in range(3)]  # rounding depends on order
    raws = [pickle.loads(pickle.dumps(pack_raw(p))) for p in parts]
    for n in (1, 2, 3):
        expected = parts[0].clone()
        for p in parts[1:n]:
            expected += p
        got = wire.sum_raw(raws[:n], torch.float32, (4, 3))
        assert got.shape == (4, 3) and torch.equal(got, expected)
        got.add_(1)  # writable, independent of the payloads
    assert torch.equal(wire.sum_raw(raws[:1], torch.float32, (4, 3)), parts[0])


def test_pack_detaches_a_tensor_that_requires_grad():
    t = torch.randn(3, 2, requires_grad=True)
    (back,) = unpack(pack(t * 2))
    assert not back.requires_grad and torch.equal(back, (t * 2).detach())
    assert torch.equal(unpack_raw(pack_raw(t), torch.float32, (3, 2)), t.detach())
