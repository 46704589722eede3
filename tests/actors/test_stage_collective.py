"""Hidden states between pipeline stages over Ray's collective tensor transport (GLOO on CPU, the
same code path as NCCL on GPUs) == host memory == local, and a restarted stage rejoins the group."""

import time

import pytest
import ray
import torch

from k3ray.actors.pipeline.executor import RayExecutor, hop_transport
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.actors.pipeline.protocol import CacheSpec, StageFailure
from k3ray.engine.execution.plan import BatchPlan
from k3ray.models.forward_batch import ModelCache
from k3ray.weights import load_model

pytestmark = pytest.mark.timeout(600)
BS = 8
SPEC = CacheSpec(num_state_slots=4, num_blocks=32, block_size=BS)
ON_NODES = dict(stage_resources={"CPU": 1, "stage_node": 1}, shard_resources={"CPU": 1, "shard_node": 1},
                router_resources={"CPU": 0.5, "stage_node": 1}, call_timeout_s=60)


def prefill(ids: torch.Tensor, slot: int) -> BatchPlan:
    n = len(ids)
    return BatchPlan(ids, torch.tensor([0, n]), torch.tensor([n]), torch.tensor([slot]),
                     torch.arange(4)[None] + 4 * slot, logits_indices=torch.arange(n))


def local_logits(checkpoint: str, plans: list[BatchPlan]) -> list[torch.Tensor]:
    model = load_model(checkpoint, torch.float32)
    cache = ModelCache.allocate(model.config, SPEC.num_state_slots, SPEC.num_blocks, BS)
    with torch.no_grad():
        return [model(p.input_ids, p.forward_batch(cache)) for p in plans]


def _stage(device: str) -> dict:
    return {"node_id": "a", "gpu_ids": ["0"] if device != "cpu" else [], "device": device, "nccl": device != "cpu"}


@pytest.mark.parametrize("devices, expected", [
    (["cpu", "cpu"], "gloo"),
    (["cpu", "cpu", "cpu"], "gloo"),
    (["cuda:0", "cpu"], "host"),  # Ray's GLOO transport carries CPU tensors only
    (["cpu"], "host"),  # one stage: no hops
])
def test_gloo_is_asked_for_and_needs_cpu_stages(devices, expected):
    parallel = ParallelConfig(pipeline=len(devices), stage_transport="gloo")
    assert hop_transport(parallel, [_stage(d) for d in devices]) == expected
    assert hop_transport(ParallelConfig(pipeline=len(devices)), [_stage("cpu") for _ in devices]) == "host"


def test_gloo_hops_equal_host_and_local_and_survive_a_stage_restart(ray_cluster, tiny_checkpoint):
    ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(3))
    plans = [prefill(row, slot) for slot, row in enumerate(ids)]
    ref = local_logits(tiny_checkpoint, plans)
    parallel = ParallelConfig(2, 2, **ON_NODES)
    host = RayExecutor(tiny_checkpoint, parallel, SPEC, name="host")
    try:
        assert host.hop_transport == "host"
        host_out = [host.step(p) for p in plans]
    finally:
        host.shutdown()

    runner = RayExecutor(tiny_checkpoint, ParallelConfig(2, 2, stage_transport="gloo", **ON_NODES), SPEC, name="gloo")
    try:
        assert runner.hop_transport == runner.health()["hop_transport"] == "gloo"
        out = runner.step(plans[0])
        # the hop carries the same fp32 tensors either way; the rest of the step is the same code
        assert torch.equal(out, host_out[0])
        # fp32 on both sides: only the summation order of the expert partials differs from local
        assert ((out - ref[0]).abs().max() / ref[0].abs().max()).item() <= 1e-5
        # stage 0 is rank 0 of the group (its rendezvous host), stage 1 the receiving end
        for victim, plan, expected in [(0, plans[1], host_out[1]), (1, plans[2], host_out[2])]:
            ray.kill(runner.groups[victim].stage, no_restart=False)
            with pytest.raises(StageFailure, match="died|failed"):
                runner.step(plan)
            # the recovery starts fresh stages and a new group over them; the next step runs on it
            deadline = time.monotonic() + 120
            while not runner.health()["healthy"]:
                assert time.monotonic() < deadline, runner.health()
                time.sleep(0.5)
            assert torch.equal(runner.step(plan), expected)
            assert runner.hop_transport == "gloo" and runner.health()["healthy"]
    finally:
        runner.shutdown()


def test_serve_settings_offer_every_stage_transport():
    from typing import get_args

    from k3ray.actors.pipeline.config import STAGE_TRANSPORTS
    from k3ray.actors.serve.config import ParallelSettings, ServeArgs

    assert get_args(ParallelSettings.model_fields["stage_transport"].annotation) == STAGE_TRANSPORTS
    args = ServeArgs.model_validate({"model": {"model": "/m"}, "parallel": {"pipeline": 2, "stage_transport": "gloo"}})
    assert args.parallel_config().stage_transport == "gloo"
