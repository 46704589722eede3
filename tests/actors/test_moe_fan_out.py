"""fan_out over real ExpertShard actors: the broadcast (small steps) and split (large steps) paths
both equal the layer's experts computed in one process."""

import pytest
import torch

from k3ray.testing import assert_close
from k3ray.weights import load_model

ray = pytest.importorskip("ray")

from k3ray.actors import moe_dispatch  # noqa: E402
from k3ray.actors.expert_shard import ExpertShard  # noqa: E402

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


@pytest.mark.parametrize("rows, broadcast_bytes", [(8, moe_dispatch.BROADCAST_BYTES), (8, 0), (300, 0), (1, 0)])
def test_fan_out_equals_the_experts_in_one_process(model_and_shards, monkeypatch, rows, broadcast_bytes):
    model, shards = model_and_shards
    monkeypatch.setattr(moe_dispatch, "BROADCAST_BYTES", broadcast_bytes)
    layer = next(i for i in range(model.config.num_layers) if model.config.is_moe_layer(i))
    moe = model.model.layers[str(layer)].block_sparse_moe
    torch.manual_seed(rows)
    with torch.no_grad():
        x = torch.randn(rows, model.config.hidden_size)
        weights, ids = moe.gate(x)  # [T, k]
        h = moe.routed_expert_down_proj(x)  # [T, Dl]
        expected = moe.experts(h, ids, weights)
    got = moe_dispatch.fan_out(shards, layer, h, ids, weights, timeout_s=60.0)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # a shard runs the CPU expert path its own rows x experts select (kernels/moe/experts_cpu.py), which
    # may not be the one the whole layer selects: the same products, but summed by other GEMM
    # kernels, so they agree to fp32 rounding (~1e-7), not bit for bit; a lost or misrouted row is O(1)
    assert_close("fan_out", expected, got, 1e-6)
