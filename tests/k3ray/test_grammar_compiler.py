"""Grammar compilation off the engine's step: real grammar worker processes, their time, memory and
cache limits, the compiled-grammar cache, and engines (LLMEngine, AsyncEngine, LLM) that keep
stepping other requests while a request waits for its grammar."""

import asyncio
import dataclasses
import json
import time

import pytest

from k3ray.engine import LLM, AsyncEngine, EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.structured.grammar_compiler import GrammarCompiler, GrammarJob, GrammarLimits
from k3ray.sampling_params import StructuredOutputsParams
from k3ray.tokenizer import ByteTokenizer


def enum_schema(n: int) -> StructuredOutputsParams:
    """n strings: 2,000 compile in well under a second, 10,000 in about one, 50,000 in minutes."""
    return StructuredOutputsParams(json={"enum": [f"value-{i:05d}" for i in range(n)]})


def finished(job: GrammarJob, timeout_s: float = 120) -> GrammarJob:
    deadline = time.monotonic() + timeout_s
    while not job.done:
        assert time.monotonic() < deadline, "the compile did not finish"
        time.sleep(0.02)
    return job


@pytest.fixture(scope="module")
def compiler():
    tok = ByteTokenizer(512)
    grammars = GrammarCompiler(tok, 512, tok.stop_token_ids, dataclasses.replace(GrammarLimits.of(), workers=1))
    yield grammars
    grammars.close()


@pytest.fixture
def limits(compiler):
    """Set the module compiler's limits for one test."""
    default = compiler.limits

    def use(**kw) -> None:
        compiler.limits = dataclasses.replace(default, **kw)

    yield use
    compiler.limits = default


def test_requests_for_one_schema_share_its_compile_and_then_its_cached_grammar(compiler):
    params = StructuredOutputsParams(json={"type": "object", "properties": {"shared": {"type": "boolean"}}})
    first, second = compiler.compile(params), compiler.compile(params)
    assert first is second and first.waiters == 2
    finished(first)
    assert first.error is None and compiler.cache_bytes >= first.compiled.memory_size_bytes
    again = compiler.compile(params)
    assert again.done and again.compiled is first.compiled  # from the cache, at once
    for job in (first, second, again):
        compiler.release(job)


def test_the_cache_keeps_the_most_recent_grammars_within_its_bytes(compiler, limits):
    size = finished(compiler.compile(enum_schema(300))).compiled.memory_size_bytes
    limits(cache_bytes=int(size * 2.5))
    jobs = [finished(compiler.compile(enum_schema(300 + i))) for i in range(4)]
    assert all(j.error is None for j in jobs) and compiler.cache_bytes <= size * 2.5
    kept, evicted = compiler.compile(enum_schema(303)), compiler.compile(enum_schema(300))
    assert kept.done and not evicted.done  # the latest stay, the oldest went
    for job in (*jobs, kept, evicted):
        compiler.release(job)


def test_a_grammar_larger_than_the_cache_is_refused(compiler, limits):
    limits(cache_bytes=64 * 1024)
    job = finished(compiler.compile(enum_schema(2000)))
    assert isinstance(job.error, ValueError) and "(grammar_cache_bytes)" in str(job.error)
    assert compiler.compile(enum_schema(2000)).done  # known to fail: at once


def test_a_compile_past_the_time_limit_kills_its_worker_and_the_next_schema_compiles(compiler, limits):
    limits(timeout_s=2)
    finished(compiler.compile(StructuredOutputsParams(json={"type": "null"})))  # a worker is up
    (worker,) = compiler._workers
    job = finished(compiler.compile(enum_schema(50_000)))
    assert isinstance(job.error, ValueError)
    assert str(job.error).startswith("structured_outputs.json: its grammar did not compile within 2 s "
                                     "(grammar_compile_timeout_s)")
    assert worker.process.poll() is not None  # killed
    assert finished(compiler.compile(StructuredOutputsParams(json={"type": "boolean"}))).error is None


def test_a_compile_past_the_memory_limit_fails_naming_it(compiler, limits):
    limits(memory_bytes=32 * 1024**2)
    job = finished(compiler.compile(enum_schema(10_000)))
    assert isinstance(job.error, ValueError) and "(grammar_compile_memory_bytes)" in str(job.error)


def test_a_queued_compile_nobody_waits_for_is_dropped(compiler, limits):
    limits(timeout_s=2)
    slow = compiler.compile(enum_schema(50_001))  # holds the one worker
    queued = compiler.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 1}))
    compiler.release(queued)
    assert not queued.done and queued not in compiler._queue
    finished(slow)
    compiler.release(slow)


# engines ----------------------------------------------------------------------------------------
COMPILE_TIMEOUT_S = 3
CACHE_BYTES = 64 * 1024  # a 2,000-string enum compiles larger


@pytest.fixture(scope="module")
def llm_engine(micro_model):
    config = EngineConfig(num_blocks=64, block_size=8, grammar_compile_timeout_s=COMPILE_TIMEOUT_S,
                          grammar_cache_bytes=CACHE_BYTES)
    llm_engine = LLMEngine(LocalExecutor(micro_model), config, ByteTokenizer(512))
    llm_engine.prepare_structured_outputs()
    yield llm_engine
    llm_engine.close()


def test_the_engine_steps_other_requests_while_one_waits_for_its_grammar(llm_engine):
    llm_engine.add_request("large", "Pick:", SamplingParams(max_tokens=8, structured_outputs=enum_schema(50_000)))
    llm_engine.add_request("plain", "Hi", SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm_engine.get_stats().num_waiting == 2
    finals, failed = {}, []
    while llm_engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in llm_engine.step() if out.finished)
        failed += llm_engine.take_failed()
        assert "plain" in finals or not failed  # the plain one finishes while the large one compiles
    assert len(finals["plain"].outputs[0].token_ids) == 4
    ((request_id, error),) = failed
    assert request_id == "large" and isinstance(error, ValueError)
    assert f"within {COMPILE_TIMEOUT_S} s (grammar_compile_timeout_s)" in str(error)
    assert "large" not in finals and not llm_engine.requests
    with pytest.raises(ValueError, match="grammar_compile_timeout_s"):  # known to fail: refused at once
        llm_engine.add_request("again", "Pick:", SamplingParams(structured_outputs=enum_schema(50_000)))


def test_a_request_waiting_for_its_grammar_can_be_aborted(llm_engine):
    llm_engine.add_request("r", "x", SamplingParams(structured_outputs=enum_schema(1999)))
    final = llm_engine.abort_request("r")
    assert final.finished and final.outputs[0].finish_reason == "abort" and not llm_engine.has_unfinished_requests()


def test_a_schema_over_the_size_limit_is_refused_before_any_compile(micro_model):
    llm = LLM(micro_model, ByteTokenizer(512), num_blocks=64, block_size=8, max_schema_bytes=100)
    with pytest.raises(ValueError, match=r"more than the limit of 100 \(max_schema_bytes\)"):
        llm.generate(["x"], SamplingParams(structured_outputs=enum_schema(20)))
    assert not llm.engine.structured.started  # no compiler started


def test_async_engine_streams_end_with_the_grammar_error_and_the_rest_run(llm_engine):
    async_engine = AsyncEngine(llm_engine)  # last: its shutdown closes the engine's grammar workers

    async def collect(request_id: str, params: SamplingParams):
        try:
            return [out async for out in async_engine.generate("Hi", params, request_id)][-1]
        except ValueError as e:
            return e

    async def run():
        results = await asyncio.gather(
            collect("large", SamplingParams(structured_outputs=enum_schema(2000))),
            collect("small", SamplingParams(max_tokens=60, seed=3, structured_outputs=StructuredOutputsParams(
                json={"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}))))
        await async_engine.shutdown()
        return results

    large, small = asyncio.run(run())
    assert isinstance(large, ValueError) and "(grammar_cache_bytes)" in str(large)
    assert small.outputs[0].finish_reason == "stop" and json.loads(small.outputs[0].text)["n"] <= 9
