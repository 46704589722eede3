"""Fault containment on a live pipeline 2 x expert-parallel 2 Serve app on loopback: a stage, shard,
router or vision encoder SIGKILLed at any moment (mid-decode, mid-prefill, between requests) fails
the requests in flight with a clean 503 (Retry-After, an OpenAI error body; a stream ends with an
error event), and the same replica serves again (recovered in place, not replaced by Serve) with
the greedy outputs it gave before.
All kill scenarios share one app, in sequence (each actor restarts at most max_restarts times)."""

import base64
import io
import json
import re
import threading
import time

import httpx
import psutil
import pytest
import ray

pytestmark = pytest.mark.timeout(600)
RECOVERY_S = 240  # generous: a recovery that never comes fails; how fast it comes is not checked
PROMPT = "Fault containment keeps serving"
LONG_PROMPT = "mid-prefill " * 60  # 720 tokens: prefilled 32 at a time, over seconds
STALE_PROMPT = "a prompt whose prefix is cached " * 4 + "and more"  # 136 tokens: a hit resumes 128 of them


@pytest.fixture(scope="module")
def server(serve_app, tiny_checkpoint):
    return serve_app({
        "model": {"model": tiny_checkpoint},
        "parallel": {"pipeline": 2, "expert_parallel": 2, "replica_cpus": 0.5, "stage_cpus": 0.5,
                     "shard_cpus": 0.5, "router_cpus": 0.25, "vision_cpus": 0.25},
        "engine": {"max_model_len": 1024, "cache_memory_mb": 32, "max_num_seqs": 4, "max_num_batched_tokens": 32},
    })


@pytest.fixture(scope="module")
def references(server) -> dict[tuple[str, int], str]:
    """Greedy outputs before any fault."""
    texts = {(prompt, n): answer(completion(server, prompt, n)) for prompt, n in ((PROMPT, 24), (STALE_PROMPT, 16))}
    return {**texts, "image": answer(image_chat(server))}


def completion(url: str, prompt: str, max_tokens: int, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def model_processes(class_name: str) -> list[psutil.Process]:
    """The processes of the app's `class_name` actors (ray::PipelineStage, ...) on this test's Ray."""
    gcs_flag = f"--gcs-address={ray.get_runtime_context().gcs_address}"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if " ".join(proc.info["cmdline"] or []).startswith(f"ray::{class_name}"):
            try:
                if gcs_flag in proc.parent().cmdline():
                    found.append(proc)
            except (psutil.Error, AttributeError):
                pass
    return sorted(found, key=lambda p: p.pid)


def kill(class_name: str, index: int = 0) -> int:
    victim = model_processes(class_name)[index]
    victim.kill()
    return victim.pid


def assert_clean_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "service_unavailable", r.text


def image_chat(url: str) -> httpx.Response:
    """A greedy chat completion about a small red image (the replica's VisionEncoder encodes it)."""
    from PIL import Image

    image = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(image, "PNG")
    data_url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url}}]
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0})


def answer(r: httpx.Response) -> str:
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.fixture
def same_replica(k3server_replicas):
    """`same_replica()` checks that the server's one K3Server replica is still the one of the test's
    start: the pipeline recovered in place (Serve replaces a replica only after failed health checks)."""
    (before,) = k3server_replicas()

    def check() -> None:
        assert [p.pid for p in k3server_replicas()] == [before.pid], "Serve replaced the replica"

    return check


def serves_again(url: str, prompt: str, n: int, reference: str, since: float, request=None,
                 within_s: float = RECOVERY_S) -> float:
    """Requests (a completion of prompt, or `request()`) until one succeeds, each failure a clean
    503, for up to `within_s` after `since` -> the seconds it took (for the log); its greedy output
    equals the one before the fault."""
    deadline = since + within_s
    while True:
        r = completion(url, prompt, n) if request is None else request()
        if r.status_code == 200:
            assert answer(r) == reference
            return time.monotonic() - since
        assert_clean_503(r)
        assert time.monotonic() < deadline, f"not serving {within_s} s after the fault: {r.text}"
        time.sleep(0.5)


class Stream(threading.Thread):
    """A streamed greedy completion read in the background: its events."""

    def __init__(self, url: str, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.events: list[str] = []
        self.status: int | None = None
        self.start()

    def run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line.removeprefix("data: "))

    def tokens(self) -> int:
        return sum(1 for e in self.events if e != "[DONE]" and "choices" in json.loads(e))

    def wait_for_tokens(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.tokens() < n:
            assert self.is_alive() and time.monotonic() < deadline, self.events[-3:]
            time.sleep(0.02)

    def ends_with_error_event(self) -> dict:
        """The stream ended with an OpenAI error event (a 503 body) and [DONE], not a dropped connection."""
        self.join(60)
        assert not self.is_alive() and self.status == 200
        assert self.events[-1:] == ["[DONE]"], self.events[-3:]
        error = json.loads(self.events[-2])["error"]
        assert error["type"] == "service_unavailable" and error["code"] == "model_unavailable", error
        return error


def test_a_shard_killed_mid_decode_fails_in_flight_requests_cleanly_then_serves_again(server, references,
                                                                                     same_replica):
    """The issue's case: a shard SIGKILLed during greedy decoding while requests keep coming (a new
    one each second): the requests in flight end with a 503 or an error event caused by the death
    (not by a call's timeout), and the same replica serves again with the greedy output it gave
    before."""
    stream = Stream(server, PROMPT, 200)
    stream.wait_for_tokens(8)
    plain: list[httpx.Response] = []
    in_flight = threading.Thread(target=lambda: plain.append(completion(server, PROMPT, 200)))
    in_flight.start()
    time.sleep(0.5)
    killed_at = time.monotonic()
    kill("ExpertShard", 1)
    error = stream.ends_with_error_event()
    in_flight.join(60)
    assert_clean_503(plain[0])
    assert "timed out" not in error["message"], error  # the death ended it
    flood, statuses = [], []
    for _ in range(5):  # requests every second meanwhile (those kept the replica broken for good)
        flood.append(threading.Thread(target=lambda: statuses.append(completion(server, PROMPT, 24))))
        flood[-1].start()
        time.sleep(1)
    for t in flood:
        t.join(120)
    for r in statuses:
        if r.status_code != 200:
            assert_clean_503(r)
    took = serves_again(server, PROMPT, 24, references[(PROMPT, 24)], killed_at)
    same_replica()
    print(f"shard killed mid-decode: serving again after {took:.1f} s; {error['message']}")


def test_a_stage_killed_mid_prefill_serves_again(server, references, same_replica):
    stream = Stream(server, LONG_PROMPT, 8)
    deadline = time.monotonic() + 60
    while not re.search(r"^k3ray:num_requests_running\{[^}]*\} 1\.0$", httpx.get(f"{server}/metrics", timeout=30).text,
                        re.MULTILINE):
        assert time.monotonic() < deadline, "the long prompt never started"
        time.sleep(0.05)
    killed_at = time.monotonic()
    kill("PipelineStage", 1)
    stream.ends_with_error_event()
    assert stream.tokens() == 0, "the kill came after the prefill"
    took = serves_again(server, PROMPT, 24, references[(PROMPT, 24)], killed_at)
    same_replica()
    print(f"stage killed mid-prefill: serving again after {took:.1f} s")


def test_a_router_killed_mid_decode_serves_again(server, references, same_replica):
    """The stages call their shards directly, so a router restart may not fail the step in flight;
    either way the request ends cleanly and the replica takes the restarted router back."""
    stream = Stream(server, PROMPT, 120)
    stream.wait_for_tokens(8)
    killed_at = time.monotonic()
    kill("MoERouter", 0)
    stream.join(120)
    last = json.loads(stream.events[-2])
    if "error" in last:
        stream.ends_with_error_event()
    took = serves_again(server, PROMPT, 24, references[(PROMPT, 24)], killed_at)
    same_replica()
    print(f"router killed mid-decode: serving again after {took:.1f} s")


def test_a_stage_killed_between_requests_never_resumes_a_lost_prefix(server, references, same_replica):
    """The restarted stage has empty caches: the prompt's cached prefix (MLA blocks and a KDA state
    snapshot in every stage) must be computed again, not resumed from a state that is gone."""
    prompt, n = STALE_PROMPT, 16
    assert completion(server, prompt, n).json()["choices"][0]["text"] == references[(prompt, n)]  # cached now
    killed_at = time.monotonic()
    pid = kill("PipelineStage", 0)
    deadline = time.monotonic() + RECOVERY_S
    while pid in [p.pid for p in model_processes("PipelineStage")] or len(model_processes("PipelineStage")) < 2:
        assert time.monotonic() < deadline, "the stage did not restart"
        time.sleep(0.2)
    took = serves_again(server, prompt, n, references[(prompt, n)], killed_at)
    same_replica()
    print(f"stage killed between requests: serving again after {took:.1f} s")


def test_a_vision_encoder_killed_between_requests_encodes_again(server, references, same_replica):
    killed_at = time.monotonic()
    kill("VisionEncoder")
    took = serves_again(server, "", 0, references["image"], killed_at, request=lambda: image_chat(server))
    same_replica()
    print(f"vision encoder killed between requests: serving images again after {took:.1f} s")


@pytest.mark.slow  # ~2 min: four restarts, Serve's three failed health checks, a new replica
def test_actors_out_of_restarts_make_serve_replace_the_replica(server, references, k3server_replicas):
    """Both routers killed once more than Ray restarts them: the pipeline cannot recover by itself,
    the replica's health check fails (HAProxy's /health turns 503) and Serve replaces the replica,
    which serves the same greedy output. Last in the module: it replaces the server's replica."""
    (old,) = k3server_replicas()
    killed_at = time.monotonic()
    for _ in range(4):  # max_restarts = 3
        pids = [p.pid for p in model_processes("MoERouter")]
        for proc in model_processes("MoERouter"):
            proc.kill()
        deadline = time.monotonic() + 60
        while len([p for p in model_processes("MoERouter") if p.pid not in pids]) < 2:
            if time.monotonic() > deadline:
                break  # out of restarts: they stay dead
            time.sleep(0.2)
    deadline = time.monotonic() + 120
    while httpx.get(f"{server}/health", timeout=30).status_code == 200:
        completion(server, PROMPT, 2)  # a request meets the dead routers
        assert time.monotonic() < deadline, "the broken pipeline never failed the health check"
        time.sleep(1)
    deadline = time.monotonic() + 240
    while [p.pid for p in k3server_replicas()] in ([], [old.pid]):
        assert time.monotonic() < deadline, "Serve did not replace the replica"
        time.sleep(1)
    took = serves_again(server, PROMPT, 24, references[(PROMPT, 24)], killed_at, within_s=600)
    print(f"routers out of restarts: a new replica serves {took:.0f} s after the first kill")
