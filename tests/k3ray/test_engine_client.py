"""The engine in its own process (EngineClient) against the same engine in process (AsyncEngine):
identical streams, errors, aborts and stats; a dead engine process fails its streams with a clear
error instead of hanging them; and the engine's delta outputs add up to its cumulative ones exactly."""

import asyncio
import functools
import os
import signal
from dataclasses import replace

import psutil
import pytest

from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import local_engine
from k3ray.engine import AsyncEngine, SamplingParams
from k3ray.engine.outputs import OutputAccumulator
from k3ray.engine.process.engine_client import EngineClient
from k3ray.engine.process.engine_core_proc import WirePrompts
from k3ray.sampling_params import RequestOutputKind

GREEDY_STOP_PROMPT = "stop here"


def request_set(stop: str) -> list:
    """Greedy with logprobs; seeded sampling, n=2, prompt logprobs; a stop string that cuts text."""
    return [
        ([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)),
        ("Hello k3", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=7, ignore_eos=True, prompt_logprobs=1)),
        (GREEDY_STOP_PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])),
    ]


@pytest.fixture(scope="module")
def args(k2_tiny_checkpoint):
    engine = {"max_model_len": 256, "cache_memory_mb": 8, "threads": 1}
    return ServeArgs.model_validate({"model": {"model": k2_tiny_checkpoint}, "engine": engine}).resolved()


@pytest.fixture(scope="module")
def requests(args):
    """The stop string: characters 4-5 of the greedy text, so the stream must cut it."""
    engine = local_engine(args)
    engine.add_request("probe", GREEDY_STOP_PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
    text = outs[0].outputs[0].text
    assert len(text) > 6, text
    return request_set(text[4:6])


@pytest.fixture(scope="module")
def client(args):
    client = EngineClient.start(functools.partial(local_engine, args), startup_timeout_s=120)
    yield client
    client.close()


async def _collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def _finals(engine, requests, tag):
    async def main():
        return await asyncio.gather(*(_collect(engine, p, params, f"{tag}-{i}") for i, (p, params) in enumerate(requests)))

    return asyncio.run(main())


def _comparable(out):
    return (out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.finished,
            [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
             for c in out.outputs])


def _without_logprobs(out):
    return (out.prompt_token_ids, out.finished,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs])


def _assert_logprobs_close(got, want, tol=1e-4):
    """fp32 logits through different kernels differ by ~1e-6 relative; 1e-4 leaves margin."""
    assert (got is None) == (want is None)
    for got_pos, want_pos in zip(got or [], want or []):
        if got_pos is None or want_pos is None:
            assert got_pos is want_pos
            continue
        assert got_pos.keys() == want_pos.keys()
        for t in got_pos:
            assert abs(got_pos[t].logprob - want_pos[t].logprob) <= tol and got_pos[t].rank == want_pos[t].rank


def test_streams_equal_the_in_process_engine(client, args, requests):
    in_process = AsyncEngine(local_engine(args))
    want = _finals(in_process, requests, "local")
    got = _finals(client, requests, "proc")
    for stream_want, stream_got in zip(want, got):
        got_final, want_final = stream_got[-1], stream_want[-1]
        # requests may share steps differently in the two runs (a decode beside a prefill takes the
        # decode kernels), so logprobs match to fp32 rounding, not bit for bit; the rest is exact
        assert _without_logprobs(got_final) == _without_logprobs(want_final)
        for got_c, want_c in zip(got_final.outputs, want_final.outputs):
            _assert_logprobs_close(got_c.logprobs, want_c.logprobs)
        _assert_logprobs_close(got_final.prompt_logprobs, want_final.prompt_logprobs)
        counts = [sum(len(c.token_ids) for c in out.outputs) for out in stream_got]
        assert counts == sorted(counts) and len(set(counts)) == len(counts)  # cumulative, one step or more each
        assert [out.finished for out in stream_got] == [False] * (len(stream_got) - 1) + [True]
    assert got[2][-1].outputs[0].finish_reason == "stop"  # the stop string was found and cut
    stats = client.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_finished >= 3


def test_image_prompt_equals_the_in_process_engine(client, args):
    """Media tensors cross the socket (plain pickle: multiprocessing's would send shared-memory
    handles the engine process cannot open)."""
    import base64
    import io

    import torch
    from PIL import Image

    from k3ray.actors.openai.protocol import ChatMessage
    from k3ray.actors.openai.serving import OpenAIServing
    from k3ray.tokenizer import load_tokenizer

    pixels = torch.randint(0, 256, (56, 84, 3), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [ChatMessage.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]})]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def answer(engine, tag):
        prompt = await OpenAIServing(engine, load_tokenizer(args.model.model), "m").chat_input(messages, True, False)
        assert prompt.media
        outs = [o async for o in engine.generate(prompt.ids, greedy, tag, media=prompt.media)]
        return outs[-1].outputs[0].token_ids

    assert asyncio.run(answer(client, "img")) == asyncio.run(answer(AsyncEngine(local_engine(args)), "img"))


def test_bad_request_raises_and_the_engine_goes_on(client):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(client, [10**9], SamplingParams(max_tokens=2), "bad")
        with pytest.raises(ValueError, match="already in flight"):
            first = client.generate([1, 2], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
            await first.__anext__()
            try:
                await _collect(client, [3], SamplingParams(max_tokens=2), "dup")
            finally:
                await first.aclose()
        return await _collect(client, [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), "ok")

    outs = asyncio.run(main())
    assert len(outs[-1].outputs[0].token_ids) == 3


def test_leaving_a_stream_aborts_it_and_frees_its_cache(client):
    async def main():
        stream = client.generate([4, 5, 6], SamplingParams(max_tokens=80, ignore_eos=True), "leave")
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):  # the abort lands before the engine's next step
            if client.get_stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        # the next request still gets its output; the abort's final output found no stream
        return await _collect(client, [7], SamplingParams(max_tokens=2, ignore_eos=True), "after")

    outs = asyncio.run(main())
    stats = client.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.cache["blocks_used"] == 0 and stats.cache["state_slots_live"] == 0
    assert outs[-1].finished


def test_delta_outputs_add_up_to_the_cumulative_ones(args, requests):
    """Two engines, the same requests in lockstep: one asked for deltas, one for cumulative outputs;
    after every step the deltas so far add up to the cumulative output (stop strings cut, n=2, logprobs
    and prompt logprobs included), each delta carries only the step's new tokens, and nothing is left
    in the wire's prompt bookkeeping once the requests finish."""
    deltas, cumulative = local_engine(args), local_engine(args)
    for i, (prompt, params) in enumerate(requests):
        deltas.add_request(f"d{i}", prompt, replace(params, output_kind=RequestOutputKind.DELTA))
        cumulative.add_request(f"d{i}", prompt, params)
    accumulators = {f"d{i}": OutputAccumulator() for i in range(len(requests))}
    engine_side, client_side = WirePrompts(), WirePrompts()
    seen = 0
    while cumulative.has_unfinished_requests():
        want = {out.request_id: out for out in cumulative.step()}
        got = deltas.step()
        assert sorted(o.request_id for o in got) == sorted(want)
        for out in got:
            assert all(len(c.token_ids) <= 1 for c in out.outputs)  # one step decodes one token
            out = client_side.restore(engine_side.strip(out))
            accumulators[out.request_id].add(out)
            assert _comparable(accumulators[out.request_id].output()) == _comparable(want[out.request_id])
            seen += 1
    assert seen > 3 and not deltas.has_unfinished_requests()
    assert not engine_side._prompts and not client_side._prompts  # finished requests are forgotten


def test_a_dead_engine_process_fails_its_streams(args):
    client = EngineClient.start(functools.partial(local_engine, args), startup_timeout_s=120)

    async def main():
        stream = client.generate([1, 2, 3], SamplingParams(max_tokens=90, ignore_eos=True), "doomed")
        await stream.__anext__()
        os.kill(client.process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process .* exited with code -9"):
            await asyncio.wait_for(_drain(stream), timeout=30)
        assert not client.alive
        with pytest.raises(RuntimeError, match="exited"):
            await _collect(client, [1], SamplingParams(max_tokens=1), "later")

    try:
        asyncio.run(main())
    finally:
        client.close()
    assert client.process.poll() is not None


async def _drain(stream):
    async for _ in stream:
        pass


def test_a_failing_factory_raises_and_leaves_no_process(tmp_path):
    def engine_processes() -> set[int]:
        return {c.pid for c in psutil.Process().children() if "engine_core_proc" in " ".join(c.cmdline())}

    before = engine_processes()
    bad = ServeArgs.model_validate({"model": {"model": str(tmp_path / "missing")}}).resolved()
    with pytest.raises(Exception, match="missing"):
        EngineClient.start(functools.partial(local_engine, bad), startup_timeout_s=120)
    assert engine_processes() <= before


def test_shutdown_stops_the_process(args):
    client = EngineClient.start(functools.partial(local_engine, args), startup_timeout_s=120)
    asyncio.run(client.shutdown())
    assert client.process.poll() == 0
    assert not client.alive



def test_handoff_parts_sent_ahead_are_joined_in_the_engine_process(client, args, k2_tiny_checkpoint):
    """Parts go to the engine process as they come and wait there for their import; dropped ones are
    gone (the import then lacks rows: a HandoffMismatchError, which makes the sender prefill again)."""
    from k3ray.engine.disagg.handoff import HandoffMismatchError

    engine = {"max_model_len": 256, "cache_memory_mb": 8, "threads": 1, "max_num_batched_tokens": 32}
    prefill = local_engine(ServeArgs.model_validate({"model": {"model": k2_tiny_checkpoint}, "engine": engine}).resolved())
    prompt = [(i * 37) % 200 + 20 for i in range(150)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefill.add_request("p", prompt, replace(greedy, output_kind=RequestOutputKind.DELTA), export_from=0,
                        export_parts=True)
    parts, final = [], None
    while final is None:
        for out in prefill.step():
            parts += [p.pack() for p in out.handoff_parts]
            final = out.handoff.pack() if out.finished else None
    assert len(parts) >= 3 and final.rows_from == parts[-1].rows_to

    async def imported(request_id):
        return [out async for out in client.generate(prompt, greedy, request_id, handoff=final)][-1]

    async def run():
        for part in parts:
            client.send_handoff_part("d", part)
        got = await imported("d")
        for part in parts:
            client.send_handoff_part("e", part)
        client.send_handoff_part("e", None)
        with pytest.raises(HandoffMismatchError, match="end at row 0"):
            await imported("e")
        return got

    got = asyncio.run(run())
    reference = local_engine(args)
    reference.add_request("ref", prompt, greedy)
    while reference.has_unfinished_requests():
        outs = reference.step()
    assert got.outputs[0].token_ids == outs[0].outputs[0].token_ids
