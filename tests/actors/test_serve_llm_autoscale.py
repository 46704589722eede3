"""Autoscaling whole pipeline x expert-parallel gangs on LLM signals, on a multi-node loopback Ray
cluster with room for 2.5 gangs: each replica of the tiny K3 is pipeline 2 x expert-parallel 2 (its
stages, routers, expert shards and vision encoder as actors in the replica's own placement group).
A ramp of long prompts fills the replicas' queues with prompt tokens; the llm policy asks for 3
replicas, 2 start whole and the third waits without a single bundle or actor; idle, it scales back
to 1 with nothing left of the others."""

import threading
import time
from collections import Counter

import httpx
import pytest
import ray

from k3ray.actors.cluster.node_environment import node_environment
from k3ray.actors.cluster.ray_connect import connect, neutral_cwd  # ray.init off the repository root

pytestmark = pytest.mark.timeout(900)
REPLICA = "ServeReplica:k3ray:K3Server"
ROLE_CLASSES = {"stage": "PipelineStage", "router": "MoERouter", "shard": "ExpertShard", "vision": "VisionEncoder"}
PROMPT = "gang " * 60  # 300 prompt tokens (bytes) per request
SETTINGS = {
    "parallel": {"pipeline": 2, "expert_parallel": 2, "replica_cpus": 0.25, "stage_cpus": 0.5, "shard_cpus": 0.5,
                 "router_cpus": 0.25, "vision_cpus": 0.25},  # 4 CPUs a gang
    "autoscaling": {"autoscale_policy": "llm", "autoscale_queued_tokens": 256, "autoscale_ttft_ms": 600_000,
                    "min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 1, "downscale_delay_s": 4,
                    "metrics_interval_s": 0.5, "look_back_period_s": 2},
    "engine": {"max_model_len": 512, "cache_memory_mb": 16, "max_num_seqs": 2, "max_num_batched_tokens": 64},
    # requests wait in the replica, where their tokens are counted; no wait bound: on 2 busy cores the
    # measured prefill rate makes 8 clients' 2,400 queued tokens look like >30 s, and the ramp is the point here
    "server": {"max_ongoing_requests": 32, "max_queue_wait_s": 0},
}


def gang(checkpoint: str) -> tuple[float, Counter]:
    """CPUs of one replica's placement group, and its model actors by class."""
    from k3ray.actors.pipeline.actor_bundles import actor_bundles
    from k3ray.actors.serve.config import ServeArgs
    from k3ray.actors.serve.replica_bundles import replica_bundles
    from k3ray.config import ModelConfig

    args = ServeArgs.model_validate({**SETTINGS, "model": {"model": checkpoint}}).resolved()
    cpus = sum(bundle["CPU"] for bundle in replica_bundles(args))
    _, roles = actor_bundles(ModelConfig.from_json_file(f"{checkpoint}/config.json"), args.parallel_config())
    return cpus, Counter(ROLE_CLASSES[role] for role, _, _ in roles)


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    """A head (no CPUs for gangs, the dashboard for the state API) and two workers of 1.25 gangs
    each; Serve's proxy ingress on the head (replicas on several nodes of one machine)."""
    from ray import serve
    from ray.cluster_utils import Cluster

    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve.isolation import free_port

    gang_cpus, _ = gang(tiny_checkpoint)
    assert (1.25 * gang_cpus).is_integer(), gang_cpus  # Ray's nodes have whole CPUs
    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if previous is not None:
        ray.shutdown()
    with pytest.MonkeyPatch.context() as env:
        for name, value in node_environment("proxy").items():
            env.setenv(name, value)  # the nodes' processes inherit it
        with neutral_cwd():
            nodes = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "include_dashboard": True, "dashboard_port": free_port()})
            for _ in range(2):
                nodes.add_node(num_cpus=int(1.25 * gang_cpus))
            nodes.wait_for_nodes()
        connect(address=nodes.address, log_to_driver=False)
        try:
            url = serve_launch.deploy({**SETTINGS, "model": {"model": tiny_checkpoint}}, port=free_port(),
                                      proxy_location="HeadOnly")
            yield url, ray.get_runtime_context().gcs_address, gang_cpus
        finally:
            serve_launch.shutdown_serve()
            ray.shutdown()
            nodes.shutdown()
            if previous is not None:
                connect(address=previous, log_to_driver=False)


def alive_actors(gcs: str) -> Counter:
    from ray.util.state import list_actors

    return Counter(a.class_name for a in list_actors(address=gcs, filters=[("state", "=", "ALIVE")], limit=1000))


def placement_groups() -> Counter:
    """Live placement groups by state (those of stopped replicas are REMOVED)."""
    return Counter(pg["state"] for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED")


def replica_states() -> Counter:
    from ray import serve

    return Counter(serve.status().applications["k3ray"].deployments["K3Server"].replica_states)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def gangs_are_whole() -> list[str]:
    """Every placement group has all of its bundles on nodes (CREATED) or none (PENDING)."""
    problems = []
    for pg in ray.util.placement_group_table().values():
        placed = [node for node in pg["bundles_to_node_id"].values() if node]
        if pg["state"] == "CREATED" and len(placed) != len(pg["bundles"]):
            problems.append(f"created with {len(placed)} of {len(pg['bundles'])} bundles placed")
        if pg["state"] == "PENDING" and placed:
            problems.append(f"pending with {len(placed)} of {len(pg['bundles'])} bundles placed")
    return problems


def assert_whole_replicas(gcs: str, n: int, per_replica: Counter) -> None:
    """n serving replicas, each with exactly its own model actors; nothing of any other replica."""
    actors = alive_actors(gcs)
    assert actors[REPLICA] == n, actors
    for name, count in per_replica.items():
        assert actors[name] == n * count, actors


def test_queued_token_ramp_scales_out_whole_gangs_and_idle_scales_back_in(cluster, tiny_checkpoint):
    url, gcs, gang_cpus = cluster
    _, per_replica = gang(tiny_checkpoint)
    assert_whole_replicas(gcs, 1, per_replica)
    total_cpus = ray.cluster_resources()["CPU"]
    stop, statuses, problems = threading.Event(), [], []

    def client():
        with httpx.Client(base_url=url, timeout=300) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                       "ignore_eos": True})
                statuses.append(r.status_code)

    def watch():
        while not stop.is_set():
            problems.extend(gangs_are_whole())
            time.sleep(0.25)

    threads = [threading.Thread(target=watch)]
    threads[0].start()
    try:
        for _ in range(8):  # the ramp: one more client each second
            threads.append(threading.Thread(target=client))
            threads[-1].start()
            time.sleep(1)
        wait_for(lambda: replica_states()["RUNNING"] == 2 and sum(replica_states().values()) == 3, 300,
                 "2 running replicas and a third waiting for room")
        wait_for(lambda: ray.available_resources().get("CPU", 0) <= total_cpus - 2 * gang_cpus + 1e-6, 60,
                 "the second gang's reservation")
        # room for half a gang more: the third replica holds no bundle, no CPU and no actor
        for _ in range(4):
            assert placement_groups()["CREATED"] == 2 and placement_groups()["PENDING"] == 1, placement_groups()
            assert ray.available_resources()["CPU"] == pytest.approx(total_cpus - 2 * gang_cpus)
            assert_whole_replicas(gcs, 2, per_replica)
            time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert statuses and set(statuses) == {200}, Counter(statuses)
    wait_for(lambda: replica_states() == Counter({"RUNNING": 1}), 240, "the scale-in to one replica")
    wait_for(lambda: alive_actors(gcs)[REPLICA] == 1 and placement_groups() == Counter({"CREATED": 1}), 120,
             "the removed replicas' actors and placement groups")
    assert_whole_replicas(gcs, 1, per_replica)
    assert not problems, problems[:5]
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
