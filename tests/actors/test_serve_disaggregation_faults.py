"""Failures of a disaggregated Serve app on loopback (two K3Prefill replicas, one K3Server decode
replica, each model in an engine process of its replica), through HTTP as a client sees them:
- a prefill replica (its actor, or its engine process) killed while it prefills a long prompt: the
  request is retried on the other prefill replica and answers as it would have;
- both prefill replicas killed, one per attempt: a 503 with Retry-After before Serve has started a
  new one; a request sent while no prefill replica is left waits for the ones Serve starts and is
  answered;
- the prefix the decode replica said it held evicted before the handoff arrives (a stream and an
  n = 2 request, which runs whole on the decode replica, fill its cache meanwhile): the retry sends
  the whole prompt;
- the decode replica killed while it streams and while a prefill runs for it: the stream ends with
  an error, the prefill pool is left holding nothing, and Serve's new decode replica serves.
After each, nothing is held once idle: no MLA block or KDA state slot of a live sequence on the
decode replica (its /metrics) or on the prefill replicas (their load reports).
Last, on an app of its own: the two pools scale independently under a ramp, each on its own signals
(the role terms themselves are unit-tested in test_llm_autoscaling.py)."""

import json
import re
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest
from ray import serve

from k3ray.actors.serve import load_signals as sig
from k3ray.actors.serve.driver_calls import call_deployment
from k3ray.actors.bench.serve.chaos import _processes as ray_processes

pytestmark = pytest.mark.timeout(900)
APP = "k3ray-pd-faults"
BS = 16
# 1.6 MiB of cache: 254 blocks of 16 tokens beside 8 state slots (4 live + 4 snapshots) of the tiny model
ENGINE = {"max_num_seqs": 4, "block_size": BS, "max_num_batched_tokens": 16, "max_model_len": 3200,
          "cache_memory_mb": 1.6}
LONG = 3000  # prompt tokens: prefilled 16 at a time, over seconds
RECOVERY_S = 240  # Serve replaces a lost replica within this (an engine process starts; 2 busy cores)


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 200 + 30 for i in range(n)]


@pytest.fixture(scope="module")
def port() -> int:
    """The module's apps' port (Serve's proxy keeps the one it started on)."""
    from k3ray.actors.serve.isolation import free_port

    return free_port()


@pytest.fixture(scope="module")
def app(serve_app, tiny_checkpoint, port):
    url = serve_app({"model": {"model": tiny_checkpoint}, "server": {"served_model_name": "k3-tiny"},
                     "engine": ENGINE, "disaggregation": {"prefill_replicas": 2, "handoff_attempts": 2}},
                    name=APP, port=port)
    wait_until(lambda: completes(url), RECOVERY_S, "the disaggregated app serving")
    return url


@pytest.fixture
def pd(app):
    """The app with both prefill replicas running their engines."""
    wait_until(lambda: prefill_engines() is not None, RECOVERY_S, "two prefill replicas with their engines")
    return app


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def completion(url: str, prompt: list[int], max_tokens: int, timeout: float = 300, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=timeout, json={
        "model": "k3-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        **fields})


def stream(url: str, prompt: list[int], max_tokens: int, events: list[str] | None = None,
           until: threading.Event | None = None) -> int:
    """A streamed greedy completion: its lines into `events`, closed early once `until` is set -> status."""
    body = {"model": "k3-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if events is not None:
                events.append(line)
            if until is not None and until.is_set():
                break
    return r.status_code


def completes(url: str) -> bool:
    try:
        return completion(url, [1, 2, 3], 1, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class InBackground(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def outcome(self, timeout_s: float = 300):
        self.join(timeout_s)
        assert not self.is_alive(), f"no answer within {timeout_s} s"
        return self.result


# the app's processes ------------------------------------------------------------------------------
def replicas(deployment: str) -> list[psutil.Process]:
    """This Ray's replica processes of `deployment` in the app."""
    return ray_processes(f"ServeReplica:{APP}:{deployment}")


def engine_of(replica: psutil.Process) -> psutil.Process | None:
    try:
        engines = [c for c in replica.children() if "k3ray.engine.process.engine_core_proc" in " ".join(c.cmdline())]
    except psutil.Error:
        return None
    return engines[0] if engines else None


def prefill_engines() -> dict[int, psutil.Process] | None:
    """Engine pid -> its K3Prefill replica process, once both replicas run and have their engines."""
    states = serve.status().applications[APP].deployments["K3Prefill"].replica_states
    pairs = {engine_of(r): r for r in replicas("K3Prefill")}
    if states.get("RUNNING", 0) != 2 or len(pairs) != 2 or None in pairs:
        return None
    return {engine.pid: replica for engine, replica in pairs.items()}


def cpu_seconds(proc: psutil.Process) -> float:
    try:
        return sum(proc.cpu_times()[:2])
    except psutil.Error:
        return 0.0


def wait_busy(pids, timeout_s: float = 120, window_s: float = 0.3) -> int:
    """The first of the processes `pids` that uses a tenth of a core over window_s: prefilling (an idle
    engine waits on its socket; a busy one gets little more than that on a loaded machine)."""
    procs = [psutil.Process(pid) for pid in pids]
    deadline = time.monotonic() + timeout_s
    while True:
        before = [cpu_seconds(p) for p in procs]
        time.sleep(window_s)
        used = [cpu_seconds(p) - b for p, b in zip(procs, before)]
        if max(used) > 0.1 * window_s:
            return procs[used.index(max(used))].pid
        assert time.monotonic() < deadline, "no prefill engine got busy"


# what the replicas hold -------------------------------------------------------------------------
def decode_metrics(url: str) -> dict[str, float]:
    body = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^k3ray:(\w+)\{[^}]*\} (\S+)$", body, re.MULTILINE)}


def decode_holds_nothing(url: str) -> bool:
    m = decode_metrics(url)
    return (m["num_requests_running"], m["num_requests_waiting"], m["mla_blocks_used"], m["state_slots_live"]) \
        == (0, 0, 0, 0)


def prefill_holds_nothing(asks: int = 6) -> bool:
    """Every answer of the pool's load reports (the handle spreads them over the replicas): no
    sequence, no prompt token waiting, no block or state slot held by a live sequence."""
    for _ in range(asks):
        load = call_deployment(APP, "K3Prefill", "record_autoscaling_stats")
        keys = (sig.RUNNING, sig.WAITING, sig.QUEUED_TOKENS, sig.MLA_BLOCK_USAGE, sig.KDA_SLOT_USAGE)
        if any(load[k] for k in keys):
            return False
    return True


def assert_nothing_held(url: str) -> None:
    wait_until(lambda: decode_holds_nothing(url), 30, f"the decode replica idle and empty: {decode_metrics(url)}")
    wait_until(prefill_holds_nothing, 30, "the prefill replicas idle and empty")


def handoff_stats() -> dict:
    return call_deployment(APP, "K3Server", "handoff_stats")


# the failures -----------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", ["replica", "engine process"])
def test_a_prefill_replica_lost_mid_prefill_is_retried_on_the_other(pd, victim):
    prompt = ids(LONG, 1 if victim == "replica" else 2)
    engines = prefill_engines()
    before = handoff_stats()
    request = InBackground(lambda: completion(pd, prompt, 8))
    busy = wait_busy(engines)
    (engines[busy] if victim == "replica" else psutil.Process(busy)).kill()
    answer = text(request.outcome())
    after = handoff_stats()
    assert after["retries"] - before["retries"] == 1 and after["handoffs"] - before["handoffs"] == 1, after
    assert_nothing_held(pd)
    assert text(completion(pd, prompt, 8)) == answer  # as an undisturbed request answers


def test_prefill_replicas_lost_on_every_attempt_end_in_a_503_with_retry_after(pd):
    engines = prefill_engines()
    request = InBackground(lambda: completion(pd, ids(LONG, 3), 8))
    first = wait_busy(engines)
    engines.pop(first).kill()
    second = wait_busy(engines)  # the retry, on the other replica
    engines[second].kill()
    lost_at = time.monotonic()
    r = request.outcome()
    new_engines = [e for e in map(engine_of, replicas("K3Prefill")) if e is not None and e.pid not in (first, second)]
    assert not new_engines, "the request waited for a new prefill replica instead of answering 503"
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["type"] == "service_unavailable" and "2 attempts" in r.json()["error"]["message"]
    wait_until(lambda: decode_holds_nothing(pd), 30, "the decode replica idle and empty")
    # with no prefill replica left, a request waits for the ones Serve starts instead
    waiting = completion(pd, ids(40, 11), 4, timeout=RECOVERY_S)
    assert waiting.status_code == 200, waiting.text
    print(f"both prefill replicas lost: serving again {time.monotonic() - lost_at:.0f} s later")
    wait_until(lambda: prefill_engines() is not None, RECOVERY_S, "two new prefill replicas")
    assert_nothing_held(pd)


def test_a_held_prefix_evicted_before_its_handoff_arrives_is_sent_again_whole(pd):
    """The decode replica (254 blocks) holds a 1,024-token prefix (64 blocks) and streams a request
    holding 125 more; it asks for the rest of a 2,524-token prompt on that prefix, and while that
    prefills, an n = 2 request (run whole on the decode replica) takes more blocks than are free or
    evictable beside the prefix, so some of the prefix's go. The handoff cannot be written; the
    retry carries the whole prompt (and waits for room until the stream is closed)."""
    prefix = ids(1024, 4)
    text(completion(pd, prefix + ids(9, 5), 1))  # the decode replica holds the prefix now
    stop = threading.Event()
    holder = InBackground(lambda: stream(pd, ids(2000, 6), 1150, until=stop))
    wait_until(lambda: decode_metrics(pd)["mla_blocks_used"] >= 125, 120, "the stream's blocks")
    prompt = prefix + ids(1500, 7)
    before = handoff_stats()
    request = InBackground(lambda: completion(pd, prompt, 8))
    wait_busy(prefill_engines())  # the decode replica has asked which prefix it holds; the rest prefills
    fill = InBackground(lambda: completion(pd, ids(1100, 8), 8, n=2))
    wait_until(lambda: handoff_stats()["retries"] > before["retries"], 120, "the handoff refused")
    stop.set()  # room for the whole prompt
    assert fill.outcome().status_code == 200 and holder.outcome(60) == 200
    answer = text(request.outcome())
    after = handoff_stats()
    assert after["retries"] - before["retries"] == 1 and after["handoffs"] - before["handoffs"] == 1, after
    assert after["tokens_sent"] - before["tokens_sent"] == len(prompt), (before, after)  # the retry's: all
    assert_nothing_held(pd)
    assert text(completion(pd, prompt, 8)) == answer


def test_a_decode_replica_lost_while_it_streams_ends_the_stream_and_is_replaced(pd):
    """Killed while it streams one request and waits on a prefill for another: the stream ends with
    an error (not a hang), the prefill replica finishes or drops its prefill and holds nothing, and
    Serve's new decode replica serves the same greedy output. Last: it replaces the decode replica."""
    prompt = ids(40, 9)
    reference = text(completion(pd, prompt, 16))
    (old,) = replicas("K3Server")
    events: list[str] = []
    streaming = InBackground(lambda: stream(pd, prompt, 3000, events))
    wait_until(lambda: len(events) > 16, 120, "the stream's first tokens")
    engines = prefill_engines()
    prefilling = InBackground(lambda: completion(pd, ids(LONG, 10), 8))
    wait_busy(engines)
    old.kill()
    lost_at = time.monotonic()
    streaming.outcome()  # each ends (not a hang): 300 s is a deadline, not a speed
    prefilling.outcome()
    data = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert "data: [DONE]" not in events or "error" in data[-1], events[-3:]  # never a clean end
    assert isinstance(streaming.error, httpx.HTTPError) or "error" in data[-1], (streaming.error, events[-3:])
    assert prefilling.error is not None or prefilling.result.status_code >= 500
    print(f"decode replica lost: the stream ended with {streaming.error!r} / {events[-1:]}, the request waiting on "
          f"its prefill with {prefilling.error or prefilling.result.status_code!r}")
    wait_until(prefill_holds_nothing, 60, "the prefill replicas idle and empty")
    wait_until(lambda: [p.pid for p in replicas("K3Server")] not in ([], [old.pid]) and completes(pd),
               RECOVERY_S, "a new decode replica serving")
    print(f"decode replica lost: a new one serves {time.monotonic() - lost_at:.0f} s later")
    assert text(completion(pd, prompt, 16)) == reference
    assert_nothing_held(pd)


# the two pools scale independently (about a minute on a quiet machine, 4 on a busy one) ------------
RAMP_APP = "k3ray-pd-ramp"
RAMP = {
    "server": {"served_model_name": "k3-tiny", "max_ongoing_requests": 16, "max_queue_wait_s": 0},
    "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 2048},
    "parallel": {"replica_cpus": 0.5},
    "autoscaling": {"autoscale_policy": "llm", "autoscale_queued_tokens": 1000, "autoscale_ttft_ms": 600_000,
                    "min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 1, "downscale_delay_s": 5,
                    "metrics_interval_s": 0.5, "look_back_period_s": 2},
    # any decoding is over an ITL target of 1 ms: the decode pool grows as soon as it streams
    "disaggregation": {"prefill_replicas": 1, "prefill_max_replicas": 3, "autoscale_itl_ms": 1},
}


@pytest.fixture(scope="module")
def ramp_app(serve_app, tiny_checkpoint, port):
    from k3ray.actors.serve.launch import delete_app

    delete_app(APP)  # done with (if it ran): its route and its replicas' CPU
    url = serve_app({**RAMP, "model": {"model": tiny_checkpoint}}, name=RAMP_APP, port=port)
    wait_until(lambda: completes(url), RECOVERY_S, "the ramp app serving")
    return url


def pool_sizes() -> tuple[int, int]:
    """(prefill, decode) replicas of the ramp app starting or running."""
    deployments = serve.status().applications[RAMP_APP].deployments
    return tuple(sum(n for state, n in deployments[d].replica_states.items() if state != "STOPPING")
                 for d in ("K3Prefill", "K3Server"))


def grow_one_pool(url: str, pool: int, clients: int, prompt_tokens: int, max_tokens: int) -> tuple[float, Counter]:
    """Clients sending requests back to back (one more each 0.5 s) until pool `pool` (0: prefill,
    1: decode) has grown, and 10 s more -> seconds it took, and the pool sizes seen all along."""
    stop, statuses, seen = threading.Event(), Counter(), Counter()

    def client(seed: int) -> None:
        while not stop.is_set():
            seed += 1000
            try:
                statuses[completion(url, ids(prompt_tokens, seed), max_tokens).status_code] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1

    def watch() -> None:
        while not stop.is_set():
            seen[pool_sizes()] += 1
            time.sleep(0.25)

    start = time.monotonic()
    threads = [InBackground(watch)]
    try:
        for seed in range(clients):
            threads.append(InBackground(lambda seed=seed: client(seed)))
            time.sleep(0.5)
        wait_until(lambda: pool_sizes()[pool] >= 2, 240, f"pool {pool} to grow")
        took = time.monotonic() - start
        time.sleep(10)  # and it holds
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert set(statuses) == {200}, statuses
    return took, seen


def test_each_pool_grows_on_its_own_load_while_the_other_stays(ramp_app):
    assert pool_sizes() == (1, 1)
    # long prompts, one token each: prompt tokens queue on the prefill pool, nothing decodes
    took, seen = grow_one_pool(ramp_app, 0, clients=6, prompt_tokens=1500, max_tokens=1)
    assert {decode for _, decode in seen} == {1}, seen
    print(f"long prompts: the prefill pool grew after {took:.0f} s, {seen}")
    wait_until(lambda: pool_sizes() == (1, 1), RECOVERY_S, "both pools back at one replica")
    # short prompts, long decodes
    took, seen = grow_one_pool(ramp_app, 1, clients=12, prompt_tokens=20, max_tokens=400)
    assert {prefill for prefill, _ in seen} == {1}, seen
    print(f"long decodes: the decode pool grew after {took:.0f} s, {seen}")
