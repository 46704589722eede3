"""Tensors cross actor calls as numpy (k3ray.actors.wire): exact for every dtype the model uses."""

import pickle

import pytest
import torch

from k3ray.actors.protocol import StepArgs
from k3ray.actors.wire import pack, unpack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8])
def test_pack_round_trip_is_bit_exact(dtype):
    t = (torch.randn(5, 7) * 100).to(dtype)
    back = unpack(pickle.loads(pickle.dumps(pack(t))))
    assert back.dtype == dtype and torch.equal(back, t)
    back.add_(1)  # writable, independent of the sender
    assert unpack(pack(None)) is None


def test_step_args_pickle_through_numpy():
    step = StepArgs(torch.arange(5), torch.tensor([0, 5]), torch.tensor([5]), torch.tensor([1]),
                    torch.arange(4)[None], logits_indices=torch.tensor([4]),
                    mm_embeds=torch.randn(2, 3, dtype=torch.bfloat16), mm_positions=torch.tensor([1, 2]))
    back = pickle.loads(pickle.dumps(step))
    for name in ("input_ids", "cu_seqlens", "context_lens", "state_slots", "block_tables", "logits_indices",
                 "mm_positions", "mm_embeds"):
        assert torch.equal(getattr(back, name), getattr(step, name)), name
    assert back.spec_state_slots is None
