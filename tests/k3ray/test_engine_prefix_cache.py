"""Prefix caching: hashed MLA blocks plus KDA / conv snapshots. A warm run must equal a cold run
token for token, and a hit may only resume where a snapshot was actually written."""

import pytest
import torch

from k3ray.config import preset
from k3ray.engine import LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.config import EngineConfig
from k3ray.models.init import build_model

MICRO = preset("k3-micro")
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BS = 8


@pytest.fixture(scope="module")
def model():
    return build_model(MICRO, seed=0)


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_engine(model, executor=None, **kw):
    config = dict(max_num_seqs=4, num_blocks=64, block_size=BS, snapshot_interval=1)
    config.update(kw)
    return LLMEngine(executor or LocalExecutor(model), EngineConfig(**config))


def run(engine, *prompts):
    ids = [engine.make_request(f"{engine.stats.num_steps}-{i}", p, PARAMS) for i, p in enumerate(prompts)]
    for request in ids:
        engine.enqueue(request)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finals[r.request_id].outputs[0].token_ids for r in ids]


def cold(model, prompt):
    return run(make_engine(model, enable_prefix_caching=False), prompt)[0]


def hits(engine):
    return engine.get_stats().prefix_cache_hits


def test_warm_run_equals_cold_run(model):
    shared = tokens(40, 0)
    first, second = shared + tokens(8, 1), shared + tokens(5, 2)
    engine = make_engine(model)
    assert run(engine, first) == [cold(model, first)]
    assert hits(engine) == 0
    assert run(engine, second) == [cold(model, second)]
    assert hits(engine) == 40  # five full shared blocks, each with a snapshot
    stats = engine.get_stats()
    assert stats.prefix_cache_hit_rate == pytest.approx(40 / (len(first) + len(second)))


def test_a_hit_that_ends_mid_block_resumes_at_the_block_boundary(model):
    first = tokens(50, 3)
    second = first[:37] + tokens(10, 4)  # diverges inside block 4
    engine = make_engine(model)
    run(engine, first)
    assert run(engine, second) == [cold(model, second)]
    assert hits(engine) == 32
    assert run(engine, first) == [cold(model, first)]  # the same prompt again: all but its last block
    assert hits(engine) == 32 + 48


def test_cached_blocks_without_a_written_snapshot_are_not_a_resume_point(model):
    first = tokens(45, 5)
    second = first[:27] + tokens(6, 6)  # three shared blocks; snapshots exist only at 16, 32, 40
    engine = make_engine(model, snapshot_interval=2)
    run(engine, first)
    cache = engine.cache
    keys = [cache.snapshot_key(engine_seq(engine, second), b) for b in (16, 24)]
    assert cache.states.lookup(keys[0]) is not None and cache.states.lookup(keys[1]) is None
    assert run(engine, second) == [cold(model, second)]
    assert hits(engine) == 16


def test_an_evicted_snapshot_is_not_used(model):
    first = tokens(41, 7)
    second = first[:20] + tokens(7, 8)
    # one live slot and two spare: the snapshots at 8 and 16 are evicted by the later ones
    engine = make_engine(model, max_num_seqs=1, num_state_slots=3)
    run(engine, first)
    seq = engine_seq(engine, second)
    assert all(engine.cache.states.lookup(engine.cache.snapshot_key(seq, b)) is None for b in (8, 16))
    assert engine.cache.blocks.lookup(engine.cache.block_hashes(seq, 2)[1]) is not None  # blocks are cached
    assert run(engine, second) == [cold(model, second)]
    assert hits(engine) == 0


def test_evicted_blocks_shorten_the_hit(model):
    first = tokens(48, 9)
    engine = make_engine(model, num_blocks=12, max_num_seqs=1, num_snapshot_slots=16)
    run(engine, first)
    run(engine, tokens(60, 10))  # needs 9 blocks, 6 are free: evicts the least recently freed, first's tail
    seq = engine_seq(engine, first)
    hashes = engine.cache.block_hashes(seq, len(first) // BS)
    cached = next(i for i, h in enumerate(hashes + [b""]) if engine.cache.blocks.lookup(h) is None)
    assert 0 < cached < 5
    before = hits(engine)
    assert run(engine, first) == [cold(model, first)]
    assert hits(engine) - before == cached * BS


def test_identical_prompts_in_one_step_do_not_read_a_pending_snapshot(model):
    prompt = tokens(33, 11)
    engine = make_engine(model)
    assert run(engine, prompt, prompt) == [cold(model, prompt)] * 2
    assert hits(engine) == 0


class FailingOnceExecutor(LocalExecutor):
    """The real executor; its first execute fails before touching the caches."""

    failed = False

    def execute(self, plan):
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().execute(plan)


def test_a_failed_step_publishes_no_snapshot_and_recovers(model):
    prompt = tokens(26, 12)
    engine = make_engine(model, executor=FailingOnceExecutor(model))
    engine.add_request("a", prompt, PARAMS)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.cache.states.num_snapshots == 0
    assert engine.cache.usage()["blocks_used"] == 0 and engine.cache.usage()["state_slots_live"] == 0
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert finals[0].outputs[0].token_ids == cold(model, prompt)
    assert engine.cache.states.num_snapshots > 0


def test_a_pending_snapshot_is_invisible_until_its_step_completes(model):
    engine = make_engine(model)
    seq = engine_seq(engine, tokens(20, 13))
    cache = engine.cache
    block_ids = cache.blocks.allocate(2)
    seq.block_table, seq.num_computed_tokens = block_ids, 16
    cache.register_blocks(seq)
    slot = cache.states.reserve_snapshot(cache.snapshot_key(seq, 16))
    assert cache.find_prefix(seq) is None
    cache.states.commit_snapshot(slot)
    hit = cache.find_prefix(seq)
    assert hit is not None and hit.num_tokens == 16 and hit.blocks == block_ids and hit.snapshot_slot == slot


def test_the_next_turn_resumes_from_the_previous_prompt_end(model):
    turn1 = tokens(29, 14)
    engine = make_engine(model, snapshot_interval=64)  # no interval snapshot below 512 tokens
    reply = run(engine, turn1)[0]
    turn2 = turn1 + reply + tokens(5, 15)
    assert run(engine, turn2) == [cold(model, turn2)]
    assert hits(engine) == 24  # the last full block of turn 1's prompt


def test_a_prompt_that_leaves_the_cached_blocks_snapshots_where_it_branches(model):
    first = tokens(45, 5)
    engine = make_engine(model, snapshot_interval=2)  # interval snapshots at 16 and 32, the prompt end at 40
    run(engine, first)
    second = first[:27] + tokens(6, 16)  # shares three blocks: resumes at 16, branches at 24
    assert run(engine, second) == [cold(model, second)]
    assert hits(engine) == 16
    assert engine.cache.states.lookup(engine.cache.snapshot_key(engine_seq(engine, second), 24)) is not None
    third = first[:30] + tokens(9, 17)
    assert run(engine, third) == [cold(model, third)]
    assert hits(engine) == 16 + 24  # from the branch point the second prompt wrote


def test_a_branch_point_just_past_an_interval_boundary_gets_no_snapshot(model):
    first = tokens(90, 29)
    engine = make_engine(model, snapshot_interval=8)  # interval snapshots every 64 tokens
    run(engine, first)
    second = first[:75] + tokens(6, 30)  # branches at 72: 8 tokens past 64, under a quarter interval (16)
    assert run(engine, second) == [cold(model, second)]
    assert engine.cache.states.lookup(engine.cache.snapshot_key(engine_seq(engine, second), 72)) is None
    assert hits(engine) == 64

def test_the_interval_snapshot_below_a_close_branch_point_outlasts_a_long_prompts_snapshots(model):
    first = tokens(90, 29)
    # one live slot, four spare (two of them may be protected), interval snapshots every 64 tokens; blocks for all
    engine = make_engine(model, max_num_seqs=1, num_state_slots=5, snapshot_interval=8, num_blocks=128)
    run(engine, first)
    run(engine, tokens(300, 31))  # unrelated: five snapshots evict the first prompt's two
    second = first[:75] + tokens(6, 30)  # branches at 72, under a quarter interval past 64: none to resume
    run(engine, second)  # writes 64, the prefix two prompts share
    run(engine, tokens(300, 32))
    last = first[:75] + tokens(8, 33)
    assert run(engine, last) == [cold(model, last)]
    assert hits(engine) == 64


def test_a_branch_point_snapshot_outlasts_a_long_prompts_snapshots(model):
    first = tokens(40, 25)
    engine = make_engine(model, max_num_seqs=1, num_state_slots=5, snapshot_interval=2)
    run(engine, first)
    run(engine, first[:27] + tokens(6, 26))  # resumes at 16, writes the branch point at 24
    run(engine, tokens(120, 27))  # unrelated: its snapshots evict one another and the unprotected ones
    last = first[:27] + tokens(8, 28)
    assert run(engine, last) == [cold(model, last)]
    assert hits(engine) == 16 + 24


def test_a_snapshot_that_served_a_hit_outlasts_a_long_prompts_snapshots(model):
    system = tokens(16, 20)
    # one live slot, four spare (two of them may be protected), a snapshot every block
    engine = make_engine(model, max_num_seqs=1, num_state_slots=5)
    run(engine, system + tokens(5, 21))
    run(engine, system + tokens(6, 22))  # resumes from the snapshot at 16: it is now protected
    assert hits(engine) == 16
    run(engine, tokens(120, 23))  # fifteen snapshots, an unrelated prompt: they evict one another
    seq = engine_seq(engine, system + tokens(7, 24))
    assert engine.cache.states.lookup(engine.cache.snapshot_key(seq, 8)) is None  # never hit: evicted
    last = system + tokens(7, 24)
    assert run(engine, last) == [cold(model, last)]
    assert hits(engine) == 32


def test_a_prompt_sharing_the_first_half_of_a_long_prompt_resumes_inside_it(model):
    document = tokens(200, 40)
    # one live slot, four spare, a snapshot every block: the document writes 25
    engine = make_engine(model, max_num_seqs=1, num_state_slots=5, num_blocks=128)
    run(engine, document)
    second = document[:100] + tokens(9, 41)
    assert run(engine, second) == [cold(model, second)]
    assert hits(engine) == 56  # the document kept 56, 104, 192 and 200 (plain LRU: 176 to 200, no hit)


def test_without_a_hit_snapshots_are_evicted_least_recently_used_first(model):
    engine = make_engine(model, max_num_seqs=1, num_state_slots=5)
    system = tokens(16, 20)
    run(engine, system + tokens(5, 21))
    run(engine, tokens(120, 23))
    seq = engine_seq(engine, system + tokens(7, 24))
    assert engine.cache.states.lookup(engine.cache.snapshot_key(seq, 16)) is None


def engine_seq(engine, prompt):
    """A sequence for `prompt`, built but not queued (to ask the cache about it)."""
    return engine.make_request(f"probe-{len(prompt)}-{prompt[-1]}", prompt, PARAMS).seqs[0]
