"""The user-facing surfaces: LLM.generate (text, n, logprobs, stop strings, checkpoints) and the
streaming AsyncEngine (incremental outputs, abort, stats)."""

import asyncio

import pytest
import torch

from k3ray.api import K3
from k3ray.config import preset
from k3ray.default_model import write_tiny_checkpoint
from k3ray.engine import LLM, AsyncEngine, EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.models.init import build_model
from k3ray.tokenizer import ByteTokenizer

MICRO = preset("k3-micro")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_model(MICRO, seed=0)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, ByteTokenizer(512), num_blocks=64, block_size=8)


def test_text_prompts_decode_to_the_output_ids(llm):
    tok = llm.tokenizer
    outs = llm.generate(["Hello there", "k3"], GREEDY)
    for prompt, out in zip(["Hello there", "k3"], outs):
        assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12
    ids = llm.generate([tok.encode("k3")], GREEDY)[0]
    assert ids.prompt is None and ids.outputs[0].token_ids == outs[1].outputs[0].token_ids
    dicts = llm.generate([{"prompt": "k3"}, {"prompt_token_ids": tok.encode("k3")}], GREEDY)
    assert [d.outputs[0].token_ids for d in dicts] == [outs[1].outputs[0].token_ids] * 2


def test_a_stop_string_cuts_the_text_and_ends_the_sequence(llm):
    full = llm.generate(["stop here"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    cut = llm.generate(["stop here"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    out = cut[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    kept = llm.generate(["stop here"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop)] + stop


def test_stop_token_ids_and_eos(llm, model):
    plain = llm.generate([[7, 8, 9]], GREEDY)[0].outputs[0].token_ids
    target = plain[4]
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target],
                                                    ignore_eos=True))[0].outputs[0]
    assert out.token_ids == plain[: plain.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    # with EOS honoured, generation ends at the first EOS exactly as the model oracle does
    k3 = K3(model)
    for prompt in ([1, 2, 3], [100, 200], [257]):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
        assert out.token_ids == k3.generate(prompt, max_new_tokens=12)


def test_n_samples_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    first = llm.generate([[1, 2, 3]], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 3
    again = llm.generate([[1, 2, 3]], params)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples


def test_logprobs_match_the_model(llm, model):
    prompt = [5, 50, 150, 250]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[0]
    comp = out.outputs[0]
    logp = torch.log_softmax(K3(model).logits(prompt + comp.token_ids), -1)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = logp[len(prompt) - 1 + i]
        assert set(row.topk(3).indices.tolist()) <= set(entry)
        assert entry[tok].rank == 1  # greedy
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)  # fp32, sum order only
        total += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(total)
    assert llm.generate([prompt], GREEDY)[0].outputs[0].cumulative_logprob is None


def test_llm_loads_a_checkpoint_directory_and_the_default(tmp_path, monkeypatch):
    path = write_tiny_checkpoint(str(tmp_path / "ckpt"))
    llm = LLM(path, num_blocks=32, block_size=8)
    assert isinstance(llm.tokenizer, ByteTokenizer)
    out = llm.generate("Once", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    monkeypatch.setenv("K3RAY_CACHE", str(tmp_path / "cache"))
    default = LLM(num_blocks=32, block_size=8)
    again = default.generate("Once", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids  # the same deterministic tiny model


def async_engine(model, **kw):
    return AsyncEngine(LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=64, block_size=8, **kw)))


def test_streams_are_incremental_and_match_generate(model, llm):
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [42]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]

    async def main():
        engine = async_engine(model)

        async def stream(i, p):
            return [out async for out in engine.generate(p, GREEDY, f"s{i}")]

        streams = await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts)))
        stats = engine.get_stats()
        await engine.shutdown()
        return streams, stats

    streams, stats = asyncio.run(main())
    for outs, want in zip(streams, expected):
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == list(range(1, 13))  # one token per step, cumulative
        assert [o.finished for o in outs] == [False] * 11 + [True]
        assert outs[-1].outputs[0].token_ids == want
    assert stats.num_finished == 3 and stats.ttft_mean_s is not None and stats.tpot_mean_s is not None
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_abort_ends_a_stream_and_frees_its_cache(model):
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def main():
        engine = async_engine(model)
        seen = []
        async for out in engine.generate([3, 1, 4, 1, 5], long, "victim"):
            seen.append(out)
            if len(seen) == 3:
                engine.abort("victim")
        leaver = engine.generate([2, 7, 1, 8], long, "leaver")
        async for _ in leaver:
            break
        await leaver.aclose()  # leaving a stream early aborts its request
        for _ in range(100):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        usage = engine.get_stats().cache
        await engine.shutdown()
        return seen, usage, engine.engine.has_unfinished_requests()

    seen, usage, unfinished = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 60
    assert not unfinished
    assert usage["blocks_used"] == 0 and usage["state_slots_live"] == 0
