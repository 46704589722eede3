"""Admission by work (actors/admission.py) on a clock the test moves: the queue is bounded by its
prompt tokens and by the wait the measured throughput predicts; the live 429 is in
test_serve_errors."""

import pytest

from k3ray.actors.admission import Admission
from k3ray.actors.openai_errors import APIError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def refused(admission: Admission, tokens: int) -> APIError:
    with pytest.raises(APIError) as e:
        admission.check(tokens)
    assert e.value.status == 429 and e.value.code == "queue_full"
    return e.value


def test_the_queue_is_bounded_by_prompt_tokens_but_an_empty_queue_takes_any_prompt():
    admission = Admission(max_queued_tokens=100, max_queue_wait_s=None, retry_after_s=2, clock=Clock())
    admission.check(500)  # larger than the bound, but nothing waits: it must not be refused forever
    first = admission.admit(60)
    admission.check(40)
    assert "60 prompt tokens are waiting (limit 100)" in str(refused(admission, 41))
    assert refused(admission, 41).headers == {"Retry-After": "2"}
    admission.started(first)
    admission.finish(first)  # idempotent after started
    assert admission.queued_tokens == 0
    admission.check(500)


def test_the_expected_wait_comes_from_the_throughput_while_busy():
    clock = Clock()
    admission = Admission(max_queued_tokens=None, max_queue_wait_s=10, retry_after_s=1, clock=clock)
    assert admission.throughput() is None
    ticket = admission.admit(1000)
    clock.now += 2.0  # 1000 tokens left the queue after 2 busy seconds: ~500 tok/s
    admission.started(ticket)
    clock.now += 100.0  # idle time does not make the replica look slow
    assert admission.throughput() == pytest.approx(500, rel=0.01)
    waiting = admission.admit(4000)  # 8 s of work queued
    admission.check(500)  # 9 s: within 10
    error = refused(admission, 1500)  # 11 s
    assert "expected wait is 11.0 s" in str(error) and error.headers == {"Retry-After": "11"}
    admission.finish(waiting)
    admission.check(10**6)
