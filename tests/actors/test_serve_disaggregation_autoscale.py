"""The two pools of a disaggregated Serve app on loopback scale independently, each on its own
signals (actors/serve/autoscaling.py, role "prefill" / "decode"): a ramp of long prompts with
max_tokens=1 grows the prefill pool on queued prompt tokens while the decode pool stays at one; once
idle both shrink back; then many concurrent long decodes of short prompts grow the decode pool on
inter-token latency while the prefill pool stays at one. The replica counts are Serve's
(serve.status()). The role terms themselves are unit-tested in test_llm_autoscaling.py."""

import threading
import time
from collections import Counter

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # ~4 min: replicas start and stop on 2 cores
APP = "k3ray-pd-ramp"
SETTINGS = {
    "server": {"served_model_name": "k3-tiny", "max_ongoing_requests": 16, "max_queue_wait_s": 0},
    "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 2048},
    "parallel": {"replica_cpus": 0.5},
    "autoscaling": {"autoscale_policy": "llm", "autoscale_queued_tokens": 1000, "autoscale_ttft_ms": 600_000,
                    "min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 1, "downscale_delay_s": 5,
                    "metrics_interval_s": 0.5, "look_back_period_s": 2},
    # any decoding is over an ITL target of 1 ms: the decode pool grows as soon as it streams
    "disaggregation": {"prefill_replicas": 1, "prefill_max_replicas": 3, "autoscale_itl_ms": 1},
}


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 200 + 30 for i in range(n)]


@pytest.fixture(scope="module")
def app(serve_app, tiny_checkpoint):
    url = serve_app({**SETTINGS, "model": {"model": tiny_checkpoint}}, name=APP)
    wait_until(lambda: post(url, [1, 2, 3], 1) == 200, 300, "the app serving")
    return url


def post(url: str, prompt: list[int], max_tokens: int) -> int:
    try:
        return httpx.post(f"{url}/v1/completions", timeout=300, json={
            "model": "k3-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def running() -> tuple[int, int]:
    """(prefill, decode) replicas RUNNING."""
    deployments = serve.status().applications[APP].deployments
    return tuple(deployments[d].replica_states.get("RUNNING", 0) for d in ("K3Prefill", "K3Server"))


def replicas() -> tuple[int, int]:
    """(prefill, decode) replicas starting or running."""
    deployments = serve.status().applications[APP].deployments
    return tuple(sum(n for state, n in deployments[d].replica_states.items() if state != "STOPPING")
                 for d in ("K3Prefill", "K3Server"))


def wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.5)
    return time.monotonic() - start


class Load:
    """`clients` threads each sending requests back to back, one more each 0.5 s, until stopped;
    the replica counts seen meanwhile."""

    def __init__(self, url: str, clients: int, prompt_tokens: int, max_tokens: int) -> None:
        self.stop, self.statuses, self.seen = threading.Event(), Counter(), Counter()
        self.threads = []
        for i in range(clients):
            self.threads.append(threading.Thread(target=self._client, args=(url, prompt_tokens, max_tokens, i)))
            self.threads[-1].start()
            time.sleep(0.5)

    def _client(self, url: str, prompt_tokens: int, max_tokens: int, seed: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            self.statuses[post(url, ids(prompt_tokens, 1000 * seed + n), max_tokens)] += 1

    def watch_until(self, predicate, timeout_s: float, what: str) -> float:
        def seen() -> bool:
            self.seen[replicas()] += 1
            return predicate()
        return wait_until(seen, timeout_s, what)

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)
        assert set(self.statuses) == {200}, self.statuses


def test_each_pool_grows_on_its_own_load_while_the_other_stays(app):
    assert replicas() == (1, 1)
    prompts = Load(app, clients=6, prompt_tokens=1500, max_tokens=1)  # prompt tokens queue on the prefill pool
    try:
        took = prompts.watch_until(lambda: running()[0] >= 2, 240, "the prefill pool to grow")
        for _ in range(10):  # and it holds while the decode pool has nothing to decode
            prompts.watch_until(lambda: True, 1, "")
            time.sleep(1)
    finally:
        prompts.end()
    assert {decode for _, decode in prompts.seen} == {1}, prompts.seen
    print(f"long prompts: the prefill pool grew after {took:.0f} s, {prompts.seen}")
    wait_until(lambda: replicas() == (1, 1), 240, "both pools back at one replica")

    decodes = Load(app, clients=12, prompt_tokens=20, max_tokens=400)  # short prompts, long decodes
    try:
        took = decodes.watch_until(lambda: running()[1] >= 2, 240, "the decode pool to grow")
        for _ in range(10):
            decodes.watch_until(lambda: True, 1, "")
            time.sleep(1)
    finally:
        decodes.end()
    assert {prefill for prefill, _ in decodes.seen} == {1}, decodes.seen
    print(f"long decodes: the decode pool grew after {took:.0f} s, {decodes.seen}")
