"""The wait admission predicts (actors/openai/admission.py: the prompt tokens ahead over the engine's measured
prefill rate) against the wait each request then has until its first output, over a ramp of arrivals
that ends past what the engine can take: the real engine and OpenAIServing, in process."""

import asyncio
import random
import statistics
import time

import torch

from k3ray.actors.openai.admission import Admission, AdmissionLimits
from k3ray.actors.openai.serving import OpenAIServing, Prompt
from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.async_engine import AsyncEngine
from k3ray.tokenizer import load_tokenizer
from k3ray.weights import load_model

RAMP = ((1.0, 3.0), (2.0, 3.0), (4.0, 4.0))  # (requests per second, seconds): the last is past saturation here
MEANINGFUL_S = 0.5  # shorter waits are a step or two: the step's own granularity, not the estimate


class RecordingAdmission(Admission):
    """Admission as the server runs it, keeping each ticket (its predicted wait) for the test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tickets = []

    def admit(self, prompts):
        ticket = super().admit(prompts)
        self.tickets.append(ticket)
        return ticket


async def ramp(serving: OpenAIServing, rng: random.Random) -> dict[int, float]:
    observed: dict[int, float] = {}

    async def one(i: int) -> None:
        ids = [rng.randrange(256) for _ in range(rng.randrange(1500, 3500))]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        started = time.monotonic()
        async for _ in serving.generate([Prompt(ids, None)], params, f"ramp-{i}"):
            observed.setdefault(i, time.monotonic() - started)

    tasks = []
    for per_s, seconds in RAMP:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(len(tasks))))
            await asyncio.sleep(1 / per_s)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    return observed


def test_the_predicted_wait_is_within_2x_of_the_observed_over_a_ramp(tiny_checkpoint):
    torch.manual_seed(0)
    tokenizer = load_tokenizer(tiny_checkpoint)
    engine = AsyncEngine(LLMEngine(LocalExecutor(load_model(tiny_checkpoint)), EngineConfig(), tokenizer))
    info = engine.info
    admission = RecordingAdmission(AdmissionLimits(None, None, 1, info.long_prompt_tokens, info.prefill_chunk_tokens),
                                   engine.get_stats)
    serving = OpenAIServing(engine, tokenizer, "ramp", None, admission)
    observed = asyncio.run(ramp(serving, random.Random(0)))
    pairs = [(t.predicted_wait_s, observed[i]) for i, t in enumerate(admission.tickets)
             if t.predicted_wait_s is not None and max(t.predicted_wait_s, observed[i]) >= MEANINGFUL_S]
    assert len(pairs) >= 10, f"the ramp made too few real waits to judge: {pairs}"
    ratios = [o / p for p, o in pairs]
    within = sum(0.5 <= r <= 2 for r in ratios) / len(ratios)
    report = [(round(p, 2), round(o, 2)) for p, o in pairs]
    assert within >= 0.75 and 0.5 <= statistics.median(ratios) <= 2, report


def test_an_aborted_long_prompt_leaves_no_backlog_and_no_false_wait(tiny_checkpoint):
    """What an aborted request computed is work the rate counts; what it left is gone from the backlog."""
    tokenizer = load_tokenizer(tiny_checkpoint)
    engine = AsyncEngine(LLMEngine(LocalExecutor(load_model(tiny_checkpoint)), EngineConfig(), tokenizer))
    info = engine.info
    admission = Admission(AdmissionLimits(65536, 30, 1, info.long_prompt_tokens, info.prefill_chunk_tokens),
                          engine.get_stats)
    serving = OpenAIServing(engine, tokenizer, "abort", None, admission)

    async def scenario():
        long = serving.generate([Prompt(list(range(256)) * 160, None)], SamplingParams(max_tokens=4), "long")
        task = asyncio.create_task(long.__anext__())
        while engine.get_stats().long_prefill_tok_s is None:  # a few steps of its prefill
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await long.aclose()  # the client went away: the request is aborted
        while engine.engine.has_unfinished_requests() or engine.get_stats().long_prefill_backlog_tokens:
            await asyncio.sleep(0.05)
        return engine.get_stats()

    stats = asyncio.run(scenario())
    assert stats.long_prefill_backlog_tokens == 0 and stats.prefill_backlog_tokens == 0
    assert admission.queued_tokens == 0 and admission.expected_wait_s([512]) is None  # no short work measured yet
    admission.check([512] * 100)  # nothing waits: after the abort no request is turned away
