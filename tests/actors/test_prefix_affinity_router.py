"""Prefix-affinity routing without a cluster: the router's prompt hashes against what a real engine
reports after running the prompt, and the choice of replica from matches and queue lengths."""

import random

import pytest

from k3ray.actors.serve.ingress_routing import block_chain, prompt_ids
from k3ray.actors.serve.request_routing import (
    MATCH_PROBES,
    PROBE_ALL,
    PROBE_OTHERS,
    HeldPrefixes,
    match_depth,
    pick_replica,
    probe_targets,
    snapshot_boundaries,
)
from k3ray.engine.llm import LLM
from k3ray.sampling_params import SamplingParams

BS = 16
SYSTEM = "You answer questions about the history of the printing press in some detail."


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t}: who printed the book number {t * 7}?"})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"The printer of book {t * 7} was someone."})
    return messages


def test_the_router_hashes_a_chat_turn_as_the_engine_caches_it(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, block_size=BS, max_num_seqs=2, snapshot_interval=64)
    first, second = {"messages": conversation(1)}, {"messages": conversation(2)}
    first_chain = block_chain(prompt_ids(llm.tokenizer, first), BS)
    second_chain = block_chain(prompt_ids(llm.tokenizer, second), BS)
    assert len(first_chain) >= 3 and second_chain[: len(first_chain)] == first_chain
    assert match_depth(first_chain, llm.get_stats().cached_prefixes) == 0

    llm.chat(first["messages"], SamplingParams(max_tokens=2, temperature=0))
    cached = llm.get_stats().cached_prefixes
    assert first_chain[-1] in cached  # the prompt's last full block: its snapshot, reported
    assert match_depth(second_chain, cached) == len(first_chain)  # the next turn resumes there
    llm.chat(second["messages"], SamplingParams(max_tokens=2, temperature=0))
    assert llm.get_stats().prefix_cache_hits >= len(first_chain) * BS


def test_completion_prompts_and_token_ids_hash_alike(tiny_checkpoint):
    from k3ray.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    text = "a prompt long enough to fill a few blocks of sixteen tokens each, and then some"
    ids = tokenizer.encode(text, allow_special=True)
    assert block_chain(prompt_ids(tokenizer, {"prompt": text}), BS) == block_chain(ids, BS)
    assert block_chain(prompt_ids(tokenizer, {"prompt": [ids, [1, 2]]}), BS) == block_chain(ids, BS)
    assert prompt_ids(tokenizer, {"input": "no prompt here"}) == []
    assert len(block_chain(ids, BS)) == len(ids) // BS
    placeholder = max(ids) + 1
    assert block_chain(ids[:20] + [placeholder] + ids[20:], BS, placeholder) == block_chain(ids[:20], BS)


def test_snapshot_boundaries_are_every_interval_and_the_last_block():
    chain = [bytes([i]) for i in range(10)]
    assert snapshot_boundaries(chain, 4) == [chain[3], chain[7], chain[9]]
    assert snapshot_boundaries(chain[:8], 4) == [chain[3], chain[7]]
    assert snapshot_boundaries([], 4) == []


CHAIN = [b"a", b"b", b"c", b"d"]
CAPACITY = {"r1": 8, "r2": 8, "r3": 8}


def test_the_longest_match_wins():
    held = {"r1": {b"a"}, "r2": {b"c"}, "r3": set()}
    assert pick_replica(CHAIN, held, {"r1": 0, "r2": 1, "r3": 0}, CAPACITY, max_imbalance=4) == "r2"


def test_a_match_of_only_a_shared_preamble_pins_nothing():
    """K3's prompts share their system preamble: a match of under half the prompt spreads by load."""
    held = {"r1": {b"a"}, "r2": set()}
    assert pick_replica(CHAIN, held, {"r1": 0, "r2": 0}, CAPACITY, max_imbalance=4) == "r2"  # fewer held
    held = {"r1": {b"b"}, "r2": set()}
    assert pick_replica(CHAIN, held, {"r1": 1, "r2": 0}, CAPACITY, max_imbalance=4) == "r1"  # half: pinned


def test_an_overloaded_or_full_target_yields_to_the_least_loaded():
    held = {"r1": {b"d"}, "r2": set()}
    assert pick_replica(CHAIN, held, {"r1": 4, "r2": 0}, CAPACITY, max_imbalance=4) == "r1"
    assert pick_replica(CHAIN, held, {"r1": 5, "r2": 0}, CAPACITY, max_imbalance=4) == "r2"
    assert pick_replica(CHAIN, held, {"r1": 8, "r2": 8}, CAPACITY, max_imbalance=4) == "r1"  # all full: keep it
    assert pick_replica(CHAIN, held, {"r1": 2, "r2": 1}, {"r1": 2, "r2": 8}, max_imbalance=4) == "r2"


def test_a_shallower_match_stands_in_when_the_deepest_is_overloaded():
    held = {"r1": {b"d"}, "r2": {b"b"}, "r3": set()}
    assert pick_replica(CHAIN, held, {"r1": 9, "r2": 1, "r3": 0}, {"r1": 16, "r2": 16, "r3": 16},
                        max_imbalance=4) == "r3"  # r2's two blocks are not the deepest match: load decides


def test_unmatched_prompts_spread_by_load_then_by_prefixes_held():
    held = {"r1": {b"x", b"y"}, "r2": {b"z"}}
    assert pick_replica(CHAIN, held, {"r1": 0, "r2": 1}, CAPACITY, max_imbalance=4) == "r1"
    assert pick_replica(CHAIN, held, {"r1": 1, "r2": 1}, CAPACITY, max_imbalance=4) == "r2"
    assert pick_replica([], held, {"r1": 0, "r2": 0}, CAPACITY, max_imbalance=4) == "r2"
    rng = random.Random(0)
    picks = {pick_replica([], {}, {"r1": 0, "r2": 0}, CAPACITY, 4, rng) for _ in range(20)}
    assert picks == {"r1", "r2"}  # even ties break both ways


def test_no_replica_is_an_error():
    with pytest.raises(AssertionError):
        pick_replica(CHAIN, {}, {}, {}, max_imbalance=4)


def test_few_replicas_are_all_probed_and_many_only_the_deepest_matches_and_two_others():
    replicas = [f"r{i}" for i in range(PROBE_ALL)]
    assert probe_targets(CHAIN, {}, replicas) == replicas
    replicas = [f"r{i}" for i in range(12)]
    held = {"r3": {b"c"}, "r5": {b"c"}, "r7": {b"c"}, "r9": {b"a"}}
    rng = random.Random(0)
    seen_deep, seen_other = set(), set()
    for _ in range(200):
        targets = probe_targets(CHAIN, held, replicas, rng)
        assert len(targets) == len(set(targets)) == MATCH_PROBES + PROBE_OTHERS
        deep = targets[:MATCH_PROBES]
        assert set(deep) <= {"r3", "r5", "r7"}  # a shallower match (r9) is not one of them
        seen_deep |= set(deep)
        seen_other |= set(targets[MATCH_PROBES:])
    assert seen_deep == {"r3", "r5", "r7"} and seen_other == set(replicas)  # chance spreads both
    unmatched = probe_targets([b"z"], held, replicas, rng)
    assert len(unmatched) == PROBE_OTHERS  # nothing matches: two by chance, as power-of-two routing


def test_held_prefixes_read_the_report_and_the_sent_hashes_in_place():
    reported, sent = frozenset({b"a", b"b"}), {b"b": 1.0, b"c": 2.0}
    held = HeldPrefixes(reported, sent)
    assert {b"a", b"b", b"c"} == set(held) and b"c" in held and b"d" not in held
    sent[b"d"] = 3.0  # later sends show without rebuilding
    assert b"d" in held and match_depth([b"x", b"d"], held) == 2
