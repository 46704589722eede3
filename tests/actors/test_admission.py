"""Admission by work (actors/openai/admission.py) over engine stats the test sets, on a clock it moves: each
lane is bounded by the prompt tokens ahead and by the wait the engine's measured prefill rate
predicts; a long prompt has a lane of its own. The live 429 is in test_serve_errors, the engine's
lanes in tests/k3ray/test_engine_long_context.py, the predicted vs observed wait in
test_admission_ramp.py."""

from dataclasses import replace

import pytest

from k3ray.actors.openai.admission import Admission, AdmissionLimits
from k3ray.actors.openai.errors import APIError
from k3ray.engine.stats import EngineStats

IDLE = EngineStats(num_running=0, num_waiting=0, num_steps=0, num_preemptions=0, prompt_tokens=0,
                   generation_tokens=0, cache={}, prefix_cache_queries=0, prefix_cache_hits=0, spec_draft_tokens=0,
                   spec_accepted_tokens=0, spec_verifications=0, num_finished=0, ttft_mean_s=None, ttft_p50_s=None,
                   ttft_p99_s=None, tpot_mean_s=None)


class Engine:
    """Stats as an engine would report them; `now` is the test's clock."""

    def __init__(self) -> None:
        self.now = 1.0
        self.latest = IDLE  # as of 0.0

    def clock(self) -> float:
        return self.now

    def report(self, **fields) -> None:
        self.now += 0.01
        self.latest = replace(IDLE, as_of=self.now, **fields)
        self.now += 0.01


def admission_over(engine: Engine, **limits) -> Admission:
    values = {"max_queued_tokens": None, "max_queue_wait_s": None, "retry_after_s": 1, "long_prompt_tokens": 10_000,
              "prefill_chunk_tokens": 1000, **limits}
    return Admission(AdmissionLimits(**values), lambda: engine.latest, clock=engine.clock)


def refused(admission: Admission, prompts: list[int]) -> APIError:
    with pytest.raises(APIError) as e:
        admission.check(prompts)
    assert e.value.status == 429 and e.value.code == "queue_full"
    return e.value


def test_the_short_lane_is_bounded_by_prompt_tokens_but_takes_any_prompt_when_nothing_waits():
    engine = Engine()
    admission = admission_over(engine, max_queued_tokens=100, retry_after_s=2)
    admission.check([500])  # larger than the bound, but nothing waits: it must not be refused forever
    first = admission.admit([60])  # not in the engine's stats yet: counted from the ticket
    assert admission.ahead("short") == 60
    admission.check([40])
    assert "60 prompt tokens are waiting (limit 100)" in str(refused(admission, [41]))
    assert refused(admission, [41]).headers == {"Retry-After": "2"}
    assert "exceed the queue's limit of 100 on their own" in str(refused(admission, [20, 90]))
    engine.report(prefill_backlog_tokens=25)  # the engine took it and prefilled 35 of its tokens
    assert admission.ahead("short") == 25 and admission.queued_tokens == 25
    admission.check([75])
    admission.started(first)
    admission.finish(first)  # idempotent after started
    engine.report()
    assert admission.queued_tokens == 0
    admission.check([500])


def test_the_expected_wait_is_the_tokens_ahead_over_the_engines_measured_rate():
    engine = Engine()
    admission = admission_over(engine, max_queue_wait_s=10)
    assert admission.expected_wait_s([100]) is None  # no rate measured yet: nothing is refused for its wait
    engine.report(prefill_backlog_tokens=4000, prefill_tok_s=500.0)  # 8 s of work queued
    assert admission.expected_wait_s([500]) == pytest.approx(9.0)
    admission.check([500])  # 9 s: within 10
    error = refused(admission, [1500])  # 11 s
    assert "4000 prompt tokens are ahead: the expected wait is 11.0 s" in str(error)
    assert error.headers == {"Retry-After": "11"}
    ticket = admission.admit([500])
    assert ticket.predicted_wait_s == pytest.approx(9.0)
    engine.report(prefill_tok_s=500.0)  # the backlog is gone (done, or aborted): nothing waits
    admission.finish(ticket)
    admission.check([10**6])


def test_a_long_prompt_never_fills_the_short_lane():
    engine = Engine()
    admission = admission_over(engine, max_queued_tokens=1000, max_queue_wait_s=30)
    long = admission.admit([900_000])  # alone over every bound: it takes the long lane
    assert long.lane == "long" and admission.ahead("short") == 0
    engine.report(long_prefill_backlog_tokens=450_000, long_prefill_tok_s=2000.0, prefill_tok_s=1000.0)
    admission.check([500])  # short requests are judged against short ones only
    short = admission.admit([500])
    assert short.predicted_wait_s == pytest.approx(0.5)
    error = refused(admission, [20_000])  # a second long prompt waits for the first: 235 s
    assert "450000 tokens of long prompts (over 10000 tokens) are ahead in their own lane" in str(error)
    assert "expected wait is 235.0 s" in str(error) and error.headers == {"Retry-After": "60"}
    admission.finish(long)
    engine.report(prefill_backlog_tokens=500, long_prefill_tok_s=2000.0, prefill_tok_s=1000.0)
    admission.check([20_000])  # the long lane is free again
    assert admission.queued_tokens == 500
