"""Bad input raises ValueError with a clear message and leaves every request in flight unaffected."""

import asyncio

import pytest
import torch

from k3ray.config import preset
from k3ray.engine import LLM, AsyncEngine, EngineConfig, LLMEngine, LocalExecutor, SamplingParams, SpeculativeConfig
from k3ray.engine.step_or_abort import step_or_abort
from k3ray.models.init import build_model

MICRO = preset("k3-micro")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def model():
    return build_model(MICRO, seed=0)


def make_engine(model, **kw):
    return LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=16, block_size=8, max_model_len=100, **kw))


BAD_REQUESTS = [
    ([1] * 101, GREEDY, "the prompt has 101 tokens, more than max_model_len=100"),
    ([1, 512], GREEDY, r"token id 512 is outside the vocabulary \[0, 512\)"),
    ([-1], GREEDY, r"token id -1 is outside the vocabulary"),
    ([], GREEDY, "the prompt is empty"),
    ([1.5, 2], GREEDY, "a prompt must be a str or a sequence of int token ids"),
    ("hello", GREEDY, "a text prompt needs a tokenizer"),
    (PROMPT, SamplingParams(max_tokens=100), "max_tokens=100 can never be reached"),
    (PROMPT, SamplingParams(stop_token_ids=[600]), r"stop_token_ids \[600\] are outside the vocabulary"),
    (PROMPT, {"temperature": 0}, "params must be SamplingParams"),
]


def test_bad_requests_raise_and_change_nothing(model):
    reference = LLM(model, num_blocks=16, block_size=8).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    engine = make_engine(model)
    engine.add_request("good", PROMPT, GREEDY)
    outputs = [engine.step(), engine.step()]
    before = (engine.cache.usage(), len(engine.scheduler.running), len(engine.scheduler.waiting))
    for prompt, params, match in BAD_REQUESTS:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", prompt, params)
        assert "bad" not in engine.requests
        assert (engine.cache.usage(), len(engine.scheduler.running), len(engine.scheduler.waiting)) == before
    with pytest.raises(ValueError, match="request_id 'good' is already in flight"):
        engine.add_request("good", PROMPT, GREEDY)
    while engine.has_unfinished_requests():
        outputs.append(engine.step())
    final = [o for step in outputs for o in step if o.finished]
    assert len(final) == 1 and final[0].outputs[0].token_ids == reference


def test_a_prompt_that_fills_max_model_len_yields_one_token(model):
    """As in vLLM: the sampled token is never fed back, so it needs no position and no cache slot."""
    engine = make_engine(model, enable_prefix_caching=False)
    prompt = [(7 * i) % 256 for i in range(100)]
    engine.add_request("full", prompt, GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (final,) = [o for o in outputs if o.finished]
    alone = LLM(model, num_blocks=16, block_size=8).generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    assert final.outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert final.outputs[0].finish_reason == "length"
    assert engine.cache.usage() == make_engine(model, enable_prefix_caching=False).cache.usage()  # all freed


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),
        ({"block_size": -4}, "block_size must be a positive int"),
        ({"num_blocks": 8, "cache_memory_bytes": 10**6}, "give num_blocks or cache_memory_bytes, not both"),
        ({"max_num_batched_tokens": 3, "speculative": SpeculativeConfig("ngram", 4)},
         "cannot hold one verification"),
        ({"num_snapshot_slots": -1}, "num_snapshot_slots must be an int >= 0"),
    ],
)
def test_bad_engine_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_bad_speculative_config_raises():
    with pytest.raises(ValueError, match="method must be 'ngram' or 'draft'"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        SpeculativeConfig("ngram", 2, ngram_min=3, ngram_max=2)


def test_engine_construction_checks_capacity_and_models(model):
    with pytest.raises(ValueError, match="max_model_len=200 exceeds what fits"):
        LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=16, block_size=8, max_model_len=200))
    with pytest.raises(ValueError, match="cache_memory_bytes=1000 does not fit"):
        LLMEngine(LocalExecutor(model), EngineConfig(cache_memory_bytes=1000))
    with pytest.raises(ValueError, match="num_state_slots=3 is below"):
        LLMEngine(LocalExecutor(model), EngineConfig(max_num_seqs=4, num_state_slots=3, num_blocks=8))
    with pytest.raises(ValueError, match="a draft model needs speculative"):
        LLMEngine(LocalExecutor(model, build_model(MICRO, seed=1)), EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match="that method needs an executor with a draft model"):
        LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=8, speculative=SpeculativeConfig("draft")))
    other_vocab = build_model(MICRO.replace(vocab_size=600), seed=0)
    with pytest.raises(ValueError, match="draft vocab_size 600 != target vocab_size 512"):
        LocalExecutor(model, other_vocab)
    with pytest.raises(ValueError, match="model must be None, a checkpoint directory or a K3ForCausalLM"):
        LLM(42)


def test_llm_generate_validates_every_prompt_before_running_any(model):
    llm = LLM(model, num_blocks=16, block_size=8, max_model_len=100)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([PROMPT, [999]], GREEDY)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([PROMPT], [GREEDY, GREEDY])
    assert not llm.engine.has_unfinished_requests()
    assert llm.get_stats().cache["blocks_used"] == 0


def test_async_bad_request_raises_while_a_good_stream_completes(model):
    reference = LLM(model, num_blocks=16, block_size=8).generate([PROMPT], GREEDY)[0].outputs[0].token_ids

    async def main():
        engine = AsyncEngine(make_engine(model))

        async def collect():
            return [out async for out in engine.generate(PROMPT, GREEDY, "good")]

        task = asyncio.create_task(collect())
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async for _ in engine.generate([1, 9999], GREEDY, "bad"):
                pass
        with pytest.raises(ValueError, match="request_id 'good' is already in flight"):
            async for _ in engine.generate(PROMPT, GREEDY, "good"):
                pass
        outs = await task
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == reference


def fail_next_forward(engine, monkeypatch, error: Exception) -> LLMEngine:
    """The engine's next forward raises `error` before it touches the caches; later ones run."""
    execute, failures = engine.executor.execute, [error]

    def failing_execute(plan):
        if failures:
            raise failures.pop()
        return execute(plan)

    monkeypatch.setattr(engine.executor, "execute", failing_execute)
    return engine


def engine_failing_once(model, monkeypatch):
    """A real engine whose first forward raises before it touches the caches (a lost device)."""
    return fail_next_forward(make_engine(model), monkeypatch, RuntimeError("device lost"))


def test_a_failed_step_aborts_every_request_with_the_cause_and_the_engine_goes_on(model, monkeypatch):
    reference = LLM(model, num_blocks=16, block_size=8).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    engine = engine_failing_once(model, monkeypatch)
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", PROMPT[:3], GREEDY)
    failed = step_or_abort(engine)
    assert failed.outputs == [] and failed.aborted == ("a", "b") and str(failed.error) == "device lost"
    assert not engine.has_unfinished_requests() and engine.cache.usage()["blocks_used"] == 0
    engine.add_request("c", PROMPT, GREEDY)
    finals = []
    while engine.has_unfinished_requests():
        step = step_or_abort(engine)
        assert step.aborted == () and step.error is None
        finals += [out for out in step.outputs if out.finished]
    assert [out.outputs[0].token_ids for out in finals] == [reference]


def test_a_failed_step_drops_the_prefix_cache(model, monkeypatch):
    """The executor may have lost the caches a prefix hit would resume from (a pipeline stage that
    restarted with empty ones): after a failed step the same prompt is computed again, and equal."""
    long_prompt = PROMPT * 4  # 28 tokens: three full blocks of 8
    reference = LLM(model, num_blocks=16, block_size=8).generate([long_prompt], GREEDY)[0].outputs[0].token_ids
    engine = make_engine(model)
    engine.add_request("a", long_prompt, GREEDY)
    while engine.has_unfinished_requests():
        step_or_abort(engine)
    assert engine.cache.resumable_prefixes()
    fail_next_forward(engine, monkeypatch, RuntimeError("stage lost"))
    engine.add_request("b", [1, 2, 3], GREEDY)
    assert step_or_abort(engine).aborted == ("b",)
    assert not engine.cache.resumable_prefixes()
    hits = engine.cache.prefix_hits
    engine.add_request("c", long_prompt, GREEDY)
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in step_or_abort(engine).outputs if out.finished]
    assert engine.cache.prefix_hits == hits and finals[0].outputs[0].token_ids == reference


def test_async_failed_step_ends_every_stream_with_the_cause(model, monkeypatch):
    async def main():
        engine = AsyncEngine(engine_failing_once(model, monkeypatch))

        async def collect(request_id):
            return [out async for out in engine.generate(PROMPT, GREEDY, request_id)]

        results = await asyncio.gather(collect("a"), collect("b"), return_exceptions=True)
        after = await collect("c")
        await engine.shutdown()
        return results, after

    results, after = asyncio.run(main())
    assert [str(r) for r in results] == ["device lost", "device lost"]
    assert all(isinstance(r, RuntimeError) for r in results)
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == GREEDY.max_tokens
