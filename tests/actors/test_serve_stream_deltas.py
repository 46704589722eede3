"""A 4,096-token stream does constant work per step on its way to the socket: at every hop (the
engine's outputs, what crosses the engine process's socket, what the OpenAI layer gets from the
engine, the SSE chunks it writes) each output carries only the tokens and text that are new, so
what a hop handles for the last thousand tokens is what it handled for the first thousand. Counted,
not timed: characters and tokens per output at each hop, with the real engine, tokenizer and
OpenAI handler (a stop string and logprobs on, so the held-back text and logprobs paths run)."""

import asyncio
import functools
import json

import pytest

from k3ray.actors.openai.chat import create_chat_completion
from k3ray.actors.openai.protocol import ChatCompletionRequest
from k3ray.actors.openai.serving import OpenAIServing
from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import local_engine
from k3ray.engine import AsyncEngine
from k3ray.engine.process import engine_client as engine_client_module
from k3ray.engine.process.engine_client import EngineClient
from k3ray.tokenizer import load_tokenizer

STREAM_TOKENS = 4096
QUARTER = 1024
# an output covers one step's token, or a few when a consumer fell behind and they were combined
MAX_TOKENS_PER_OUTPUT = 64


@pytest.fixture(scope="module")
def args(k2_tiny_checkpoint):
    engine = {"max_model_len": STREAM_TOKENS + 256, "cache_memory_mb": 64, "threads": 1, "max_num_seqs": 4}
    return ServeArgs.model_validate({"model": {"model": k2_tiny_checkpoint}, "engine": engine}).resolved()


class Hop:
    """Per output seen at one hop: (tokens it carries, characters it carries)."""

    def __init__(self) -> None:
        self.outputs: list[tuple[int, int]] = []

    def record(self, out) -> None:
        self.outputs.append((sum(len(c.token_ids) for c in out.outputs), sum(len(c.text) for c in out.outputs)))

    def check_constant(self, name: str) -> None:
        """Each output is small, and the work (tokens + characters) per token of the stream's last
        quarter is that of its first: cumulative outputs would make it grow with the position."""
        assert self.outputs, f"{name}: no outputs"
        assert max(tokens for tokens, _ in self.outputs) <= MAX_TOKENS_PER_OUTPUT, name
        first, last = _per_token_work(self.outputs, 0, QUARTER), _per_token_work(self.outputs, STREAM_TOKENS - QUARTER,
                                                                                  STREAM_TOKENS)
        assert last <= 1.5 * first + 1, f"{name}: {first:.2f} units per token at the start, {last:.2f} at the end"


def _per_token_work(outputs: list[tuple[int, int]], start: int, end: int) -> float:
    """(tokens + characters) handled per token over the outputs covering tokens [start, end)."""
    position, work, tokens = 0, 0, 0
    for n, chars in outputs:
        if start <= position < end and n:
            work, tokens = work + n + chars, tokens + n
        position += n
    return work / max(tokens, 1)


def _request() -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": STREAM_TOKENS,
        "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 1,
        "stop": ["zq#never-appears"], "stream_options": {"include_usage": True}})


async def _stream(serving: OpenAIServing, served: Hop) -> tuple[list[str], Hop]:
    """The SSE chunks of one chat stream, recording what the OpenAI layer got from the engine."""
    generate = serving.generate

    async def recording(*a, **kw):
        async for i, out in generate(*a, **kw):
            served.record(out)
            yield i, out

    serving.generate = recording
    stream = await create_chat_completion(serving, _request())
    return [chunk async for chunk in stream], served


def _check_sse(chunks: list[str]) -> None:
    """Every chunk's bytes are those of its own tokens: the last quarter's chunks are no larger."""
    bodies = [json.loads(c.removeprefix("data: ")) for c in chunks if c.startswith("data: {")]
    usage = bodies[-1]["usage"]
    assert usage["completion_tokens"] == STREAM_TOKENS, usage
    sizes = [len(c) for c, body in zip(chunks, bodies) if body["choices"] and body["choices"][0]["delta"]]
    head, tail = sizes[1 : QUARTER // 4], sizes[-QUARTER // 4 :]
    assert max(tail) <= 1.5 * max(head), (max(head), max(tail))
    assert len(sizes) >= STREAM_TOKENS // MAX_TOKENS_PER_OUTPUT


@pytest.mark.slow  # ~80 s; the engine-process test below covers the same hops by default
def test_in_process_engine_stream_is_constant_work_per_step(args):
    engine = local_engine(args)
    engine_hop, served = Hop(), Hop()
    step = engine.step

    def recording_step():
        outputs = step()
        for out in outputs:
            engine_hop.record(out)
        return outputs

    engine.step = recording_step
    async_engine = AsyncEngine(engine)
    serving = OpenAIServing(async_engine, load_tokenizer(args.model.model), "k3")

    async def main():
        try:
            return await _stream(serving, served)
        finally:
            await async_engine.shutdown()

    chunks, _ = asyncio.run(main())
    engine_hop.check_constant("engine outputs")
    served.check_constant("outputs the OpenAI layer got")
    _check_sse(chunks)


def test_engine_process_stream_is_constant_work_per_step(args, monkeypatch):
    """Through the engine's own process (a server's default): the socket carries the engine's
    deltas (each message's outputs are small) and the client hands them on as they are."""
    socket_hop, served, unreadable = Hop(), Hop(), []

    def recording_recv(conn):
        message = recv(conn)
        if message[0] == "step":
            try:
                for out in message[1]:
                    socket_hop.record(out)
            except AttributeError as e:  # not RequestOutputs: failed below, not in the reader thread
                unreadable.append(e)
        return message

    recv = engine_client_module.recv
    monkeypatch.setattr(engine_client_module, "recv", recording_recv)
    client = EngineClient.start(functools.partial(local_engine, args), startup_timeout_s=120)
    try:
        serving = OpenAIServing(client, load_tokenizer(args.model.model), "k3")
        chunks, _ = asyncio.run(_stream(serving, served))
    finally:
        client.close()
    served.check_constant("outputs the OpenAI layer got")
    assert not unreadable, f"the socket carried something other than RequestOutputs: {unreadable[0]}"
    socket_hop.check_constant("outputs across the engine process's socket")
    _check_sse(chunks)
