"""Expert balancing: the EPLB-style placement on hand examples, and rebalancing during a stream of
greedy requests on the multi-node loopback cluster changes no output (the dispatch over replicas
on real shards: test_moe_fan_out.py)."""

import pytest
import torch

from k3ray.actors.pipeline.executor import RayExecutor
from k3ray.actors.pipeline.expert_placement import Placement, balance, max_over_mean
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.tokenizer import load_tokenizer
from k3ray.weights import load_model

TWO_SHARDS = Placement.static([(0, 4), (4, 8)])
SKEWED = torch.tensor([100, 50, 10, 10, 5, 5, 5, 5])  # shard 0 holds the hot experts


def test_shard_loads_split_an_expert_over_its_copies():
    assert TWO_SHARDS.shard_loads(SKEWED) == [170.0, 20.0]
    placement = Placement(TWO_SHARDS.ranges, ((), (0,)))
    assert placement.copies(0) == [0, 1] and placement.copies(5) == [1]
    assert placement.shard_loads(SKEWED) == [120.0, 70.0]
    assert max_over_mean([120.0, 70.0]) == pytest.approx(240 / 190)
    assert max_over_mean([0.0, 0.0]) == 1.0


@pytest.mark.parametrize("slots, replicas, loads", [
    (0, ((), ()), [170.0, 20.0]),
    (1, ((), (0,)), [120.0, 70.0]),  # the hottest expert first
    (2, ((), (0, 1)), [95.0, 95.0]),  # then the next hottest per copy
])
def test_balance_replicates_the_hottest_experts_on_the_quietest_shard(slots, replicas, loads):
    placement = balance(TWO_SHARDS, SKEWED, slots)
    assert placement.replicas == replicas and placement.version == 1
    assert placement.shard_loads(SKEWED) == loads


def test_balance_leaves_a_balanced_load_alone():
    assert balance(TWO_SHARDS, torch.full((8,), 7), 2).replicas == ((), ())
    assert balance(TWO_SHARDS, torch.zeros(8, dtype=torch.long), 2).replicas == ((), ())
    with pytest.raises(ValueError, match="slots_per_shard"):
        balance(TWO_SHARDS, SKEWED, -1)


def test_pair_owners_alternate_over_copies_in_step_order():
    placement = Placement(TWO_SHARDS.ranges, ((), (0,)))
    ids = torch.tensor([[0, 1], [0, 5], [2, 0], [0, 7]])
    # expert 0's pairs in order go to shard 0, 1, 0, 1; the others to their home shard
    assert placement.pair_owners(ids).tolist() == [[0, 0], [1, 1], [0, 0], [1, 1]]
    assert placement.pair_owners_list(ids.flatten().tolist()) == [0, 0, 1, 1, 0, 0, 1, 1]  # small steps' path


ON_NODES = dict(stage_resources={"CPU": 1, "stage_node": 1}, shard_resources={"CPU": 1, "shard_node": 1},
                router_resources={"CPU": 0.5, "stage_node": 1})
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8, num_blocks=64)
PROMPTS = ["the quick brown fox jumps over the lazy dog", "abababababab", "one two three four five", "hello"]


def stream(engine, tokenizer):
    """Greedy requests arriving one after another while earlier ones decode."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    outs, pending = {}, list(enumerate(PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return outs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dispatch", ["direct", "router", "compiled"])
def test_rebalancing_during_a_greedy_stream_changes_no_output(ray_cluster, tiny_checkpoint, dispatch):
    tok = load_tokenizer(tiny_checkpoint)
    ref = stream(LLMEngine(LocalExecutor(load_model(tiny_checkpoint)), CONFIG, tok), tok)
    # a new placement every 3 steps of a stage, up to 2 replicas per shard
    parallel = ParallelConfig(2, 2, moe_dispatch=dispatch, redundant_experts=2, rebalance_steps=3, **ON_NODES)
    executor = RayExecutor(tiny_checkpoint, parallel)
    try:
        got = stream(LLMEngine(executor, CONFIG, tok), tok)
        placements = executor.expert_placements()
    finally:
        executor.shutdown()
    for p in placements:  # both stages took up placements with replicas during the stream
        assert p["in_use"] >= 1 and p["replicated_placements"] >= 1, p
    assert got.keys() == ref.keys()
    for rid, out in got.items():
        assert out.token_ids == ref[rid].token_ids, rid
        for pos_got, pos_ref in zip(out.logprobs, ref[rid].logprobs):
            assert pos_got.keys() == pos_ref.keys()
            for t in pos_got:  # fp32 logits equal up to the expert partial-sum order, as test_ray_executor
                assert abs(pos_got[t].logprob - pos_ref[t].logprob) <= 1e-4
