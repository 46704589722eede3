"""Prefix-affinity routing on a real two-replica Serve app behind HAProxy (loopback): each turn of a
conversation lands on the replica that cached the turn before, and unrelated prompts spread over
both. Where a prompt ran is read from the replicas themselves: the prefixes each one's cache can
resume from (K3Server.record_routing_stats, the report the router routes on)."""

import time

import httpx
import pytest
import ray

from k3ray.actors.serve.ingress_routing import (
    block_chain,
    haproxy_routes_through_router,
    prompt_ids,
    serve_haproxy_config,
)
from k3ray.actors.serve.request_routing import PREFIXES_STAT
from k3ray.tokenizer import load_tokenizer

BS = 16
TURNS = 5


@pytest.fixture(scope="module")
def two_replicas(serve_app, tiny_checkpoint):
    args = {"model": {"model": tiny_checkpoint}, "autoscaling": {"min_replicas": 2, "max_replicas": 2},
            "engine": {"max_num_seqs": 4, "block_size": BS, "engine_process": False},
            "routing": {"routing_stats_period_s": 0.5}}
    url = serve_app(args)
    deadline = time.monotonic() + 300
    while not haproxy_routes_through_router(2) or httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "HAProxy did not come to route through the ingress router"
        time.sleep(1)
    time.sleep(2)  # HAProxy reloads the config it was given
    return url, load_tokenizer(tiny_checkpoint)


def replica_actors() -> dict:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and "#K3Server#" in a["name"]]
    return {name: ray.get_actor(name, namespace="serve") for name in names}


def holders(last_hash: bytes) -> set[str]:
    """The replicas whose cache can resume from the prefix ending in `last_hash`."""
    reports = {name: ray.get(actor.record_routing_stats.remote()) for name, actor in replica_actors().items()}
    return {name for name, report in reports.items() if last_hash in report[PREFIXES_STAT]}


def chat(url: str, messages: list[dict]) -> str:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                          json={"messages": messages, "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_a_conversations_turns_stay_on_one_replica(two_replicas):
    url, tokenizer = two_replicas
    messages = [{"role": "system", "content": "You are a careful assistant who answers in full sentences."}]
    served_by = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me one more fact about harbour number {turn}."})
        chain = block_chain(prompt_ids(tokenizer, {"messages": messages}), BS)
        messages.append({"role": "assistant", "content": chat(url, messages)})
        (replica,) = holders(chain[-1])  # cached by exactly one replica: the one that ran it
        served_by.append(replica)
    assert len(set(served_by)) == 1, served_by


def test_unrelated_prompts_reach_both_replicas(two_replicas):
    url, tokenizer = two_replicas
    # ties go to the replica holding fewer prefixes, so the one still holding the conversation of the
    # test before gets a prompt once the other holds more: up to 24 prompts, each on exactly one replica.
    # Each shares K3's prompt preamble (the thinking-effort statement), which is under half of it: a
    # match of the preamble alone pins nothing (request_routing.MIN_MATCH_FRACTION)
    served_by = []
    for i in range(24):
        question = f"Unrelated question {i}: " + "why is the sky blue? " * (16 + i % 3)
        messages = [{"role": "user", "content": question}]
        chain = block_chain(prompt_ids(tokenizer, {"messages": messages}), BS)
        chat(url, messages)
        served_by.extend(holders(chain[-1]))
        assert len(served_by) == i + 1, served_by
        if len(set(served_by)) == 2:
            break
    assert len(set(served_by)) == 2, served_by


def test_haproxy_keeps_k3rays_rewrites_with_the_router(two_replicas):
    """k3ray-haproxy's changes hold for the router's backend too: no fallback to Serve's proxy
    (a pin-miss balances over the replicas instead), probes answered by HAProxy, no connection reuse."""
    config = serve_haproxy_config()
    assert "-via-ingress-request-router" in config and "use-server" in config
    assert " backup" not in config and "http-reuse always" not in config
    url, _ = two_replicas
    response = httpx.get(f"{url}/health", timeout=5)
    assert response.status_code == 200 and response.headers.get("X-K3ray-Answered-By") == "ingress"
