"""Autoscaling whole model pipelines on ongoing requests (Serve's policy; the llm policy is in
test_serve_llm_autoscale.py): each replica is an expert-parallel pipeline (a stage, a MoE
router and two expert shards as Ray actors in the replica's own placement group). A burst of
requests scales to 2 replicas and the quiet after it back to 1, with no actor or placement group
left behind."""

import threading
import time
from collections import Counter

import httpx
import pytest
import ray

from k3ray.actors.cluster.ray_connect import connect  # ray.init off the repository root
from k3ray.actors.serve.isolation import free_port

pytestmark = pytest.mark.timeout(600)
MODEL_ACTORS = {"PipelineStage": 1, "MoERouter": 1, "ExpertShard": 2}  # per replica (expert_parallel=2)
REPLICA = "ServeReplica:k3ray:K3Server"


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    """A local Ray with the dashboard (the state API needs it), fractional CPUs for the actors."""
    from ray import serve

    from k3ray.actors.serve import launch as serve_launch

    # the state API needs a dashboard: leave a session-wide test cluster for a moment, rejoin it after
    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if previous is not None:
        ray.shutdown()
    serve_launch.start_ray(num_cpus=16, log_to_driver=False, include_dashboard=True, dashboard_port=free_port())
    gcs = ray.get_runtime_context().gcs_address
    try:
        url = serve_launch.deploy({
            "model": {"model": tiny_checkpoint},
            "parallel": {"expert_parallel": 2, "replica_cpus": 0.5, "stage_cpus": 0.5, "shard_cpus": 0.5,
                         "router_cpus": 0.25},
            "autoscaling": {"autoscale_policy": "ongoing-requests", "min_replicas": 1, "max_replicas": 2,
                            "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
                            "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 2},
            "engine": {"max_model_len": 256, "cache_memory_mb": 16, "max_num_seqs": 4},
        }, port=free_port(), proxy_location="HeadOnly")
        yield url, gcs
    finally:
        serve.shutdown()
        leftover = alive_actors(gcs)
        serve_launch.stop()  # Ray down, its runtime folder and the environment start_ray set undone
        if previous is not None:
            connect(address=previous, log_to_driver=False)
    assert not any(leftover[name] for name in [REPLICA, *MODEL_ACTORS]), leftover


def alive_actors(gcs: str) -> Counter:
    from ray.util.state import list_actors

    return Counter(a.class_name for a in list_actors(address=gcs, filters=[("state", "=", "ALIVE")], limit=1000))


def live_placement_groups() -> int:
    return sum(pg["state"] == "CREATED" for pg in ray.util.placement_group_table().values())


def running_replicas() -> int:
    from ray import serve

    return serve.status().applications["k3ray"].deployments["K3Server"].replica_states.get("RUNNING", 0)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def assert_whole_replicas(gcs: str, n: int) -> None:
    """n replicas, each with exactly its own model actors, and one placement group each."""
    actors = alive_actors(gcs)
    assert actors[REPLICA] == n, actors
    for name, per_replica in MODEL_ACTORS.items():
        assert actors[name] == n * per_replica, actors
    assert live_placement_groups() == n


def test_burst_scales_to_two_pipelines_and_back(cluster):
    url, gcs = cluster
    assert_whole_replicas(gcs, 1)
    stop, statuses, latencies = threading.Event(), [], []

    def client():
        with httpx.Client(base_url=url, timeout=300) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                r = http.post("/v1/completions", json={"prompt": "scale", "max_tokens": 8, "temperature": 0,
                                                       "ignore_eos": True})
                statuses.append(r.status_code)
                latencies.append(time.monotonic() - t0)

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: running_replicas() == 2, 240, "a second replica")
        assert_whole_replicas(gcs, 2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert statuses and set(statuses) == {200}, Counter(statuses)
    wait_for(lambda: running_replicas() == 1 and alive_actors(gcs)[REPLICA] == 1, 180, "the scale-down")
    wait_for(lambda: alive_actors(gcs)["ExpertShard"] == 2 and live_placement_groups() == 1, 60,
             "the removed replica's actors and placement group")
    assert_whole_replicas(gcs, 1)
    httpx.post(f"{url}/v1/completions", json={"prompt": "load", "max_tokens": 2}, timeout=120)
    load = [line for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines()
            if line.startswith("k3ray:expert_load_tokens_total{")]
    assert len(load) == 8 and sum(float(line.rsplit(" ", 1)[1]) for line in load) > 0  # the tiny model's 8 experts
    print(f"burst: {len(latencies)} requests of 8 tokens, mean latency {sum(latencies) / len(latencies):.2f}s")


def test_a_dead_expert_shard_answers_503_with_retry_after_then_recovers(cluster):
    """SIGKILL one expert shard of the pipeline: a request answers 503 with Retry-After and an
    OpenAI error body (not a 500), and Serve's health check brings the pipeline back."""
    import os
    import signal

    from ray.util.state import list_actors

    url, gcs = cluster
    (shard, *_) = list_actors(address=gcs, filters=[("class_name", "=", "ExpertShard"), ("state", "=", "ALIVE")])
    os.kill(shard.pid, signal.SIGKILL)
    body = {"prompt": "dead shard", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "service_unavailable" and int(r.headers["retry-after"]) >= 1, r.text
    deadline = time.monotonic() + 240
    while httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code != 200:
        assert time.monotonic() < deadline, "the pipeline did not come back"
        time.sleep(1)
    wait_for(lambda: alive_actors(gcs)["ExpertShard"] == 2, 120, "the replaced replica's shards")
