"""Property test: over 1,000 randomized requests (shared prefixes, sampling, n > 1, stops, aborts at
random steps, preemption and cache eviction forced by small pools), every step keeps the cache
accounting consistent, and once all requests finish or are aborted nothing is held."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3ray.config import preset
from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams, SpeculativeConfig
from k3ray.models.init import build_model

MICRO = preset("k3-micro")
BASES = [list(range(10, 40)), list(range(100, 130)), [7, 7, 7, 8] * 8]
REQUESTS_PER_EXAMPLE = 40


@pytest.fixture(scope="module")
def model():
    return build_model(MICRO, seed=0)


def small_engine(model, speculative=None, long_lane=False):
    # 24 blocks of 4 tokens for up to 6 sequences of up to ~45 tokens: preemption and eviction; with
    # long_lane, prompts over 20 tokens take the long lane and long sequences leave 16 tokens to the rest
    lanes = {"long_prefill_token_threshold": 20, "long_context_reserve": 16} if long_lane else {}
    return LLMEngine(LocalExecutor(model), EngineConfig(
        max_num_seqs=6, max_num_batched_tokens=16, num_blocks=24, block_size=4, snapshot_interval=1,
        num_snapshot_slots=4, max_model_len=48, speculative=speculative, **lanes))


request = st.fixed_dictionaries({
    "base": st.integers(0, len(BASES) - 1),
    "shared": st.integers(0, 30),
    "tail": st.lists(st.integers(0, 511), min_size=1, max_size=6),
    "max_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0.0, 0.0, 1.0]),
    "n": st.sampled_from([1, 1, 1, 2]),
    "stop": st.sampled_from([(), (), (257,), (7, 300)]),
    "abort_at": st.one_of(st.none(), st.none(), st.integers(0, 12)),
    "arrive_at": st.integers(0, 8),
})


def check_accounting(engine):
    cache, sched = engine.cache, engine.scheduler
    refs = [0] * cache.geometry.num_blocks
    live = []
    for seq in sched.running:
        for b in seq.block_table:
            refs[b] += 1
        live += [seq.state_slot] + seq.spec_slots
        assert cache.blocks_for(seq.num_computed_tokens) <= len(seq.block_table)
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.state_slot is None
    assert refs == cache.blocks.ref
    assert len(set(live)) == len(live) == cache.states.num_live
    assert not set(live) & set(cache.states.free) and not set(live) & set(cache.states.key_of)
    states = cache.states
    snapshots = set(states.valid.values())
    assert snapshots == set(states.evictable) | set(states.protected) | (snapshots & set(states.pins))
    assert not set(states.evictable) & set(states.protected) and not set(states.pins) & set(states.evictable)
    assert len(states.protected) <= states.max_protected and states.reused <= snapshots | set(states.pending.values())
    assert set(states.placed) <= snapshots | set(states.pending.values())  # no run position outlives its snapshot
    assert len(cache.blocks.free) + len(cache.blocks.cached) + sum(r > 0 for r in refs) == cache.geometry.num_blocks
    # long sequences grow within their cap; one that grew past the threshold may still hold what it took before
    long_seqs = [s for s in sched.running if s.num_tokens > sched.long_threshold]
    carried = len(long_seqs) * cache.blocks_for(sched.long_threshold + sched.num_spec + 1)
    assert sum(len(s.block_table) for s in long_seqs) <= sched.long_block_cap + carried


def drive(engine, requests):
    """Requests arrive at steps 0..8 and some are aborted at a given step; step until all are done."""
    ids, limits = {}, {}
    step = 0
    while len(ids) < len(requests) or engine.has_unfinished_requests():
        for i, r in enumerate(requests):
            if r["arrive_at"] == step:
                prompt = BASES[r["base"]][: r["shared"]] + r["tail"]
                params = SamplingParams(n=r["n"], temperature=r["temperature"], max_tokens=r["max_tokens"],
                                        stop_token_ids=r["stop"], seed=i)
                ids[i] = f"{id(requests)}-{i}"
                limits[ids[i]] = r["max_tokens"]
                engine.add_request(ids[i], prompt, params)
        for i, r in enumerate(requests):
            if r["abort_at"] == step and i in ids:
                engine.abort_request(ids[i])
        for out in engine.step():
            assert all(len(c.token_ids) <= limits[out.request_id] for c in out.outputs)
        check_accounting(engine)
        step += 1


def assert_nothing_held(engine):
    usage = engine.cache.usage()
    assert usage["blocks_used"] == 0 and usage["state_slots_live"] == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    assert not engine.cache.states.pins and not engine.cache.states.pending
    assert usage["state_slots_free"] + usage["state_slots_snapshot"] == usage["state_slots_total"]


@pytest.mark.parametrize("speculative, examples, long_lane", [
    (None, 20, False), (SpeculativeConfig("ngram", 3), 5, False), (None, 8, True)])
def test_no_slot_or_block_leaks_after_1000_random_requests(model, speculative, examples, long_lane):
    engine = small_engine(model, speculative, long_lane)
    assert engine.scheduler.long_block_cap == (24 - 4 if long_lane else 24)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(request, min_size=REQUESTS_PER_EXAMPLE, max_size=REQUESTS_PER_EXAMPLE))
    def run(requests):
        drive(engine, requests)
        assert_nothing_held(engine)

    run()
    stats = engine.get_stats()
    assert stats.num_finished + stats.num_steps > 0
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
