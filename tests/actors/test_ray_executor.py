"""The engine on the Ray executor == the engine on the local executor: greedy tokens and
log-probabilities, with prefix caching and n-gram speculative decoding on, across layouts."""

import pytest
import torch

from k3ray.actors.pipeline.executor import RayExecutor
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams, SpeculativeConfig
from k3ray.tokenizer import load_tokenizer
from k3ray.weights import load_model

pytestmark = pytest.mark.timeout(900)
ON_NODES = dict(stage_resources={"CPU": 1, "stage_node": 1}, shard_resources={"CPU": 1, "shard_node": 1},
                router_resources={"CPU": 0.5, "stage_node": 1})
CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=8, num_blocks=96, snapshot_interval=1,
                      enable_prefix_caching=True, speculative=SpeculativeConfig("ngram", 3))


def workload(tokenizer):
    shared = "the quick brown fox jumps over the lazy dog. " * 3
    prompts = [shared + "one", shared + "two", "abababababab", shared + "one more time"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    return prompts, params


def run(engine, prompts, params):
    # two waves: the second hits the prefix cache filled by the first
    outs = {}
    for wave in (prompts[:2], prompts[2:]):
        for i, p in enumerate(wave):
            engine.add_request(f"{p[-8:]}-{i}", p, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0]
    return outs


def local_result(checkpoint):
    tok = load_tokenizer(checkpoint)
    engine = LLMEngine(LocalExecutor(load_model(checkpoint)), CONFIG, tok)
    prompts, params = workload(tok)
    return run(engine, prompts, params), engine.get_stats()


# the echo model accepts drafts; the random tiny model rejects them (rollback by slot choice)
@pytest.mark.parametrize("pipeline, expert_parallel, model, dispatch", [
    (1, 1, "echo", "router"), (2, 2, "echo", "router"), (3, 4, "echo", "direct"), (2, 2, "random", "router"),
    (2, 2, "random", "direct"), (2, 2, "random", "compiled")])
def test_ray_executor_equals_local(ray_cluster, echo_checkpoint, tiny_checkpoint, pipeline, expert_parallel, model,
                                   dispatch):
    checkpoint = echo_checkpoint if model == "echo" else tiny_checkpoint
    ref, ref_stats = local_result(checkpoint)
    tok = load_tokenizer(checkpoint)
    executor = RayExecutor(checkpoint, ParallelConfig(pipeline, expert_parallel, moe_dispatch=dispatch, **ON_NODES))
    try:
        engine = LLMEngine(executor, CONFIG, tok)
        prompts, params = workload(tok)
        got = run(engine, prompts, params)
        stats = engine.get_stats()
    finally:
        executor.shutdown()
    assert stats.prefix_cache_hits > 0 and stats.spec_draft_tokens > 0
    if model == "echo":
        assert stats.spec_accepted_tokens > 0
    else:
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert (stats.spec_accepted_tokens, stats.spec_draft_tokens) == (ref_stats.spec_accepted_tokens,
                                                                     ref_stats.spec_draft_tokens)
    assert stats.prefix_cache_hits == ref_stats.prefix_cache_hits
    assert got.keys() == ref.keys()
    for rid, out in got.items():
        assert out.token_ids == ref[rid].token_ids, rid
        for pos_got, pos_ref in zip(out.logprobs, ref[rid].logprobs):
            assert pos_got.keys() == pos_ref.keys()
            for t in pos_got:
                # fp32 logits equal up to the expert partial-sum order (<= 1e-5 relative on logits)
                assert abs(pos_got[t].logprob - pos_ref[t].logprob) <= 1e-4


def test_draft_model_speculation_is_refused_clearly(tiny_checkpoint):
    executor = RayExecutor(tiny_checkpoint, ParallelConfig(1, 1))
    with pytest.raises(ValueError, match="ngram"):
        executor.propose(None)
    assert executor.cache_layout()[0][0].num_layers == 9 and torch.float32 == executor.dtype
