"""`k3ray bench soak --chaos`: a bounded soak of a pipeline 2 x expert-parallel 2 server on loopback
while a random pipeline stage, expert shard or the Serve replica itself is SIGKILLed every
--fault-every seconds (each once the previous fault has recovered).

It starts k3ray's Serve app itself (the tiny K3 unless --model): it kills that server's processes
on this machine. --concurrency clients send greedy completions of a few fixed prompts for
--duration seconds (and on until the last fault recovered), each waiting Retry-After seconds after
a 503. Each request ends ok, failed with a clean 503 (Retry-After and an OpenAI error body), or lost
(anything else: a dropped connection, a timeout, another status). The JSON holds `requests`, `ok`,
`failed_503`, `lost` (and `lost_by_type`), `faults` ([{target, at_s, recovered_s}]: recovered = the
first success of a request sent after the fault's last failure, null if none before the next fault
or the end), `recovery_s` (the worst; null if one never recovered) and `outputs_identical` (every
success's greedy output equals its prompt's output before the first fault).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import ray

from k3ray.bench.common import machine
from k3ray.actors.bench.serve.server import auth_headers, local_serve_app, server_facts
from k3ray.threads import resolved_threads

TARGETS = {"stage": "ray::PipelineStage", "shard": "ray::ExpertShard", "replica": "ServeReplica:k3ray:K3Server"}
PROMPTS = ("Chaos soak: the quick brown fox", "A pipeline of experts, killed at random",
           "Greedy outputs must not change after a recovery", "Fault containment")
SETTLE_S = 3.0  # a fault counts as recovered once requests succeed with none failing for this long
RECOVERY_TIMEOUT_S = 300.0  # longest wait for one fault's recovery before the next


def serve_args(model: str | None, concurrency: int, threads: int | None = None) -> dict[str, Any]:
    """The server under chaos: pipeline 2 x expert-parallel 2, every actor on a fraction of a CPU."""
    args: dict[str, Any] = {
        "parallel": {"pipeline": 2, "expert_parallel": 2, "replica_cpus": 0.5, "stage_cpus": 0.5,
                     "shard_cpus": 0.25, "router_cpus": 0.25, "vision_cpus": 0.25},
        "engine": {"max_num_seqs": max(8, concurrency), "threads": threads},
    }
    if model is not None:
        args["model"] = {"model": model}
    return args


@dataclass(frozen=True)
class Outcome:
    start: float
    end: float
    prompt: str
    kind: str  # "ok", "failed_503", or how it was lost
    text: str | None = None
    retry_after_s: float = 0.0


def run_chaos(args: argparse.Namespace) -> dict[str, Any]:
    if args.endpoint is not None:
        raise ValueError("--chaos kills the processes of a server it starts itself: leave out --endpoint")
    for name in ("duration", "fault_every"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    with local_serve_app(serve_args(args.model, args.concurrency, resolved_threads(args.threads))) as url:
        model, _ = server_facts(url, None, api_key=args.api_key)
        return asyncio.run(_chaos(args, url, model))


async def _chaos(args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits,
                                 headers=auth_headers(args.api_key)) as http:
        references = {}
        for prompt in PROMPTS:
            first = await _greedy(http, model, prompt, args.max_tokens)
            if first.kind != "ok":
                raise RuntimeError(f"the server failed before any fault: {first.kind}")
            references[prompt] = first.text
        t0 = time.monotonic()
        stop = t0 + args.duration
        outcomes: list[Outcome] = []
        faults: list[dict[str, Any]] = []
        done = asyncio.Event()  # the last fault recovered (or timed out): the load may end

        async def client(c: int) -> None:
            i = c
            while not done.is_set():
                outcome = await _greedy(http, model, PROMPTS[i % len(PROMPTS)], args.max_tokens)
                outcomes.append(outcome)
                await asyncio.sleep(outcome.retry_after_s)  # as a client told to retry later does
                i += 1

        clients = [asyncio.create_task(client(c)) for c in range(args.concurrency)]
        await _inject_faults(random.Random(args.seed), args.fault_every, stop, outcomes, faults)
        await asyncio.sleep(max(0.0, stop - time.monotonic()))
        done.set()
        await asyncio.gather(*clients)
    kinds = [o.kind for o in outcomes]
    lost = [k for k in kinds if k not in ("ok", "failed_503")]
    report_faults = [{"target": f["target"], "at_s": round(f["at"] - t0, 1),
                      "recovered_s": _recovered_s(f["at"], faults[k + 1]["at"] if k + 1 < len(faults) else None,
                                                  outcomes)}
                     for k, f in enumerate(faults)]
    recoveries = [f["recovered_s"] for f in report_faults]
    return {
        "requests": len(outcomes),
        "ok": kinds.count("ok"),
        "failed_503": kinds.count("failed_503"),
        "lost": len(lost),
        "lost_by_type": {k: lost.count(k) for k in sorted(set(lost))},
        "faults": report_faults,
        "recovery_s": None if None in recoveries else max(recoveries, default=0.0),
        "outputs_identical": all(o.text == references[o.prompt] for o in outcomes if o.kind == "ok"),
        "outputs_differing": sum(o.text != references[o.prompt] for o in outcomes if o.kind == "ok"),
        "duration_s": round(time.monotonic() - t0, 1),
        "machine": machine(),
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("json", "api_key")},
    }


async def _inject_faults(rng: random.Random, every_s: float, stop: float, outcomes: list[Outcome],
                         faults: list[dict[str, Any]]) -> None:
    """Kill a random stage, shard or replica every `every_s` seconds until `stop`, each once the last
    recovered; returns once the last recovered (the load goes on until then)."""
    next_at = time.monotonic() + every_s
    while True:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if time.monotonic() >= stop:
            return
        target = rng.choice(sorted(TARGETS))
        victims = await asyncio.to_thread(_processes, TARGETS[target])
        if not victims:  # e.g. a replica still starting its actors
            next_at = time.monotonic() + 1.0
            continue
        rng.choice(victims).kill()
        at = time.monotonic()
        faults.append({"target": target, "at": at})
        recovered = await _wait_recovered(at, outcomes, at + RECOVERY_TIMEOUT_S)
        next_at = max(at + every_s, recovered + SETTLE_S)


async def _wait_recovered(at: float, outcomes: list[Outcome], deadline: float) -> float:
    """Until a request sent after the fault's latest failure has succeeded and none failed for SETTLE_S."""
    while time.monotonic() < deadline:
        failures = [o.end for o in outcomes if o.end >= at and o.kind != "ok"]
        since = max(failures, default=at)
        if time.monotonic() - since >= SETTLE_S and any(o.kind == "ok" and o.start >= since for o in outcomes):
            return time.monotonic()
        await asyncio.sleep(0.2)
    return time.monotonic()


def _recovered_s(at: float, next_at: float | None, outcomes: list[Outcome]) -> float | None:
    """Seconds from a fault to the first success of a request sent after its last failure (before the next fault)."""
    end = float("inf") if next_at is None else next_at
    failed = [o.end for o in outcomes if at <= o.end < end and o.kind != "ok"]
    since = max(failed, default=at)
    ok = [o.end for o in outcomes if o.kind == "ok" and since <= o.start < end]
    return round(min(ok) - at, 1) if ok else None


def _processes(mark: str) -> list:
    """This Ray's processes whose command line starts with (actors) or holds (the replica) `mark`."""
    gcs_flag = f"--gcs-address={ray.get_runtime_context().gcs_address}"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if cmd.startswith(mark) or (not mark.startswith("ray::") and mark in cmd):
            try:
                if gcs_flag in proc.parent().cmdline():
                    found.append(proc)
            except (psutil.Error, AttributeError):
                pass
    return found


async def _greedy(http, model: str, prompt: str, max_tokens: int) -> Outcome:
    """One greedy completion -> its outcome."""
    start = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    try:
        r = await http.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        return Outcome(start, time.monotonic(), prompt, type(e).__name__)
    end = time.monotonic()
    try:
        payload = r.json()
    except ValueError:
        return Outcome(start, end, prompt, f"http_{r.status_code}_not_json")
    if r.status_code == 200:
        return Outcome(start, end, prompt, "ok", payload["choices"][0]["text"])
    retry_after = r.headers.get("retry-after", "")
    clean = (r.status_code == 503 and retry_after.isdigit()
             and isinstance(payload.get("error"), dict) and payload["error"].get("message"))
    if not clean:
        return Outcome(start, end, prompt, f"http_{r.status_code}")
    return Outcome(start, end, prompt, "failed_503", retry_after_s=float(retry_after))
