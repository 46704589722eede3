"""The model as Ray actors (stages, routers, expert shards) on a real 3-node cluster == local."""

import time

import pytest
import ray
import torch

from k3ray.actors.pipeline.executor import RayExecutor
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.actors.pipeline.protocol import CacheSpec, StageFailure
from k3ray.engine.execution.plan import BatchPlan
from k3ray.models.forward_batch import ModelCache
from k3ray.weights import load_model

pytestmark = pytest.mark.timeout(600)
BS = 8
SPEC = CacheSpec(num_state_slots=4, num_blocks=32, block_size=BS)
ON_NODES = dict(stage_resources={"CPU": 1, "stage_node": 1}, shard_resources={"CPU": 1, "shard_node": 1},
                router_resources={"CPU": 0.5, "stage_node": 1})


def steps(ids: torch.Tensor, chunks: list[int], slot: int = 0):
    pos = 0
    for n in chunks:
        yield BatchPlan(ids[pos : pos + n], torch.tensor([0, n]), torch.tensor([pos + n]), torch.tensor([slot]),
                        torch.arange(8)[None], logits_indices=torch.arange(n))
        pos += n


def local_logits(model, step_list):
    cache = ModelCache.allocate(model.config, SPEC.num_state_slots, SPEC.num_blocks, BS)
    out = []
    with torch.no_grad():
        for s in step_list:
            out.append(model(s.input_ids, s.forward_batch(cache)))
    return out


@pytest.fixture(scope="module")
def local_model(tiny_checkpoint):
    return load_model(tiny_checkpoint, torch.float32)


# the engine-level tests (test_ray_executor.py) cover pipeline 1-3 x expert-parallel 1, 2, 4
@pytest.mark.parametrize("pipeline, expert_parallel, dispatch", [(2, 2, "router"), (1, 4, "direct"), (2, 2, "compiled")])
def test_ray_pipeline_equals_local(ray_cluster, tiny_checkpoint, local_model, pipeline, expert_parallel, dispatch):
    parallel = ParallelConfig(pipeline, expert_parallel, moe_dispatch=dispatch, **ON_NODES)
    runner = RayExecutor(tiny_checkpoint, parallel, SPEC)
    try:
        nodes = {name.split()[0]: node for name, node in runner.placement.items()}
        stage_nodes = {n for name, n in runner.placement.items() if name.startswith("stage")}
        shard_nodes = {n for name, n in runner.placement.items() if name.startswith("expert")}
        assert len(stage_nodes) == 1 and len(shard_nodes) == 1 and stage_nodes != shard_nodes, nodes
        # no GPUs asked: every model actor computes on the CPU, hidden states go through host memory
        infos = ray.get([h.ready.remote() for name, h in runner.actors() if not name.startswith("router")], timeout=60)
        assert {info["device"] for info in infos} == {"cpu"} and runner.hop_transport == "host"
        ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(pipeline))
        plan = list(steps(ids, [12, 1, 5, 1]))
        ref = local_logits(local_model, plan)
        for s, r in zip(plan, ref):
            out = runner.step(s)
            # fp32 on both sides, same kernels: only summation order of the expert partials differs
            assert ((out - r).abs().max() / r.abs().max()).item() <= 1e-5
            assert torch.equal(out.argmax(-1), r.argmax(-1))
        load = runner.expert_load()
        assert sum(map(sum, load)) == 19 * local_model.config.num_experts_per_token * 8  # 8 MoE layers
    finally:
        runner.shutdown()


@pytest.mark.parametrize("dispatch, victim", [("router", "expert shard 4-7 of stage 1"),
                                              ("direct", "expert shard 4-7 of stage 1"),
                                              ("compiled", "expert shard 4-7 of stage 1"), ("compiled", "stage 1")])
def test_dead_actor_fails_the_step_then_recovers(ray_cluster, tiny_checkpoint, local_model, dispatch, victim):
    """An actor dies between a request's prefill and decode: the step fails on the death itself, not
    on call_timeout_s. With compiled dispatch a dead shard breaks the stage's compiled graph (compiled
    again over the restarted shard), and a restarted stage restarts its shards, which the dead
    stage's graph still holds."""
    parallel = ParallelConfig(2, 2, call_timeout_s=60, moe_dispatch=dispatch, **ON_NODES)
    runner = RayExecutor(tiny_checkpoint, parallel, SPEC)
    try:
        ids = torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(0))
        first, second = steps(ids, [9, 1])
        runner.step(first)
        _, actor = next((n, h) for n, h in runner.actors() if n.startswith(victim))
        ray.kill(actor, no_restart=False)  # dies between the prefill and the decode of the request
        with pytest.raises(StageFailure, match="died|failed") as failed:
            runner.step(second)
        assert "timed out" not in str(failed.value) and "Timeout" not in str(failed.value), failed.value
        # the shard restarts and reloads its weights; a new request succeeds and is correct
        deadline = time.monotonic() + 120
        while not runner.health()["healthy"]:
            assert time.monotonic() < deadline, runner.health()
            time.sleep(1)
        fresh = list(steps(ids, [10], slot=1))
        out = runner.step(fresh[0])
        ref = local_logits(local_model, fresh)[0]
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    finally:
        runner.shutdown()


def test_bad_parallel_config_is_a_value_error(tiny_checkpoint):
    with pytest.raises(ValueError, match="pipeline"):
        ParallelConfig(pipeline=0)
    with pytest.raises(ValueError, match="placement_strategy"):
        ParallelConfig(placement_strategy="RANDOM")
    with pytest.raises(ValueError, match="moe_dispatch"):
        ParallelConfig(moe_dispatch="allreduce")


def test_node_that_leaves_shows_in_health_and_fails_steps(ray_cluster, tiny_checkpoint):
    cluster, _ = ray_cluster
    extra = cluster.add_node(num_cpus=4, resources={"doomed_node": 100})
    cluster.wait_for_nodes()
    parallel = ParallelConfig(1, 2, stage_resources={"CPU": 1, "stage_node": 1},
                              shard_resources={"CPU": 1, "doomed_node": 1}, call_timeout_s=30, max_restarts=0)
    runner = RayExecutor(tiny_checkpoint, parallel, SPEC)
    try:
        assert runner.health()["healthy"]
        cluster.remove_node(extra)
        deadline = time.monotonic() + 90
        while not (report := runner.health())["lost_nodes"]:
            assert time.monotonic() < deadline, "the lost node never showed in health()"
            time.sleep(1)
        assert not report["healthy"]
        assert any(v != "alive" for k, v in report["actors"].items() if k.startswith("expert shard"))
        ids = torch.randint(0, 256, (4,))
        with pytest.raises(StageFailure) as failed:
            runner.step(next(steps(ids, [4])))
        assert "timed out" not in str(failed.value), failed.value  # refused for its dead actors
    finally:
        runner.shutdown()
