"""fan_out over real ExpertShard actors: the broadcast (small steps) and split (large steps) paths,
and the split over expert replicas (expert balancing), equal the layer's experts computed in one
process."""

import time

import pytest
import ray
import torch

from k3ray.actors.pipeline import moe_dispatch
from k3ray.actors.pipeline.expert_placement import Placement
from k3ray.actors.pipeline.expert_shard import ExpertShard
from k3ray.testing import assert_close
from k3ray.weights import load_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_and_shards(ray_cluster, tiny_checkpoint):
    model = load_model(tiny_checkpoint, torch.float32)
    config = model.config
    E = config.num_experts
    ranges = [(0, E // 4), (E // 4, E // 2), (E // 2, E)]  # uneven, and a shard some rows miss
    actors = [ray.remote(ExpertShard).options(num_cpus=0.1, resources={"shard_node": 1}).remote(
        tiny_checkpoint, (0, config.num_layers), r) for r in ranges]
    ray.get([a.ready.remote() for a in actors])
    yield model, [(e0, e1, a) for (e0, e1), a in zip(ranges, actors)]
    for a in actors:
        ray.kill(a)


def experts_in_one_process(model, rows: int):
    """A MoE layer's routed-expert inputs for `rows` random tokens, and its experts' output here."""
    layer = next(i for i in range(model.config.num_layers) if model.config.is_moe_layer(i))
    moe = model.model.layers[str(layer)].block_sparse_moe
    torch.manual_seed(rows)
    with torch.no_grad():
        x = torch.randn(rows, model.config.hidden_size)
        weights, ids = moe.gate(x)  # [T, k]
        h = moe.routed_expert_down_proj(x)  # [T, Dl]
        return layer, h, ids, weights, moe.experts(h, ids, weights)


@pytest.mark.parametrize("rows, broadcast_bytes", [(8, moe_dispatch.BROADCAST_BYTES), (8, 0), (300, 0), (1, 0)])
def test_fan_out_equals_the_experts_in_one_process(model_and_shards, monkeypatch, rows, broadcast_bytes):
    model, shards = model_and_shards
    monkeypatch.setattr(moe_dispatch, "BROADCAST_BYTES", broadcast_bytes)
    layer, h, ids, weights, expected = experts_in_one_process(model, rows)
    got = moe_dispatch.fan_out(shards, layer, h, ids, weights, timeout_s=60.0)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # a shard runs the CPU expert path its own rows x experts select (kernels/moe/experts_cpu.py), which
    # may not be the one the whole layer selects: the same products, but summed by other GEMM
    # kernels, so they agree to fp32 rounding (~1e-7), not bit for bit; a lost or misrouted row is O(1)
    assert_close("fan_out", expected, got, 1e-6)


def wait_for_replicas(shards, wanted, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while ray.get([s.held_replicas.remote() for _, _, s in shards]) != [sorted(w) for w in wanted]:
        assert time.monotonic() < deadline, "replicas did not load"
        time.sleep(0.1)


@pytest.mark.parametrize("rows, broadcast_bytes", [(8, moe_dispatch.BROADCAST_BYTES), (300, 0), (1, 0)])
def test_fan_out_over_replicas_equals_the_experts_in_one_process(model_and_shards, monkeypatch, rows,
                                                                 broadcast_bytes):
    model, shards = model_and_shards
    E = model.config.num_experts
    # every expert of the first shard has a copy on the last, expert E - 1 one on the first
    placement = Placement(tuple((e0, e1) for e0, e1, _ in shards), ((E - 1,), (), tuple(range(E // 4))), 1)
    try:
        for (_, _, shard), experts in zip(shards, placement.replicas):
            ray.get(shard.add_replicas.remote(list(experts)))
        wait_for_replicas(shards, placement.replicas)
        monkeypatch.setattr(moe_dispatch, "BROADCAST_BYTES", broadcast_bytes)
        layer, h, ids, weights, expected = experts_in_one_process(model, rows)
        got = moe_dispatch.fan_out(shards, layer, h, ids, weights, 60.0, placement)
        # as above: the same products summed in another order, fp32 rounding
        assert_close("fan_out over replicas", expected, got, 1e-6)
        # a placement naming a replica the shard does not hold (a restarted shard) fails, never adds 0
        ray.get(shards[2][2].keep_replicas.remote([0]))
        assert ray.get(shards[2][2].held_replicas.remote()) == [0]
        stale = Placement(placement.ranges, ((), (), (1,)), 2)
        ids = torch.tensor([[1, E - 1], [1, E - 2]])  # expert 1's second pair goes to the last shard's copy
        with pytest.raises(ray.exceptions.RayTaskError, match="holds no replica of expert 1"):
            moe_dispatch.fan_out(shards, layer, torch.randn(2, h.shape[1]), ids, torch.ones(2, 2), 60.0, stale)
    finally:
        ray.get([shard.keep_replicas.remote([]) for _, _, shard in shards])
