"""One step of an engine that serves many callers. A step that raises has been rolled back by the
engine, so every unfinished request is aborted and fails with that cause: no caller waits on a
request that was in the failed batch, and the engine is left idle and consistent. The prefix cache
is dropped too: the executor may have lost the caches it points into (a pipeline stage restarted
with empty ones), and a prefix hit would resume from state that is no longer there."""

from __future__ import annotations

from dataclasses import dataclass

from k3ray.engine.llm_engine import LLMEngine
from k3ray.engine.outputs import RequestOutput


@dataclass(frozen=True)
class StepOutcome:
    outputs: list[RequestOutput]  # the step's outputs; empty when it failed
    aborted: tuple[str, ...] = ()  # request ids the failed step took down
    error: Exception | None = None  # why the step failed


def step_or_abort(engine: LLMEngine) -> StepOutcome:
    """Run one engine step; if it raises, abort every unfinished request and return the error."""
    try:
        return StepOutcome(engine.step())
    except Exception as e:  # noqa: BLE001 - reported to each aborted request's caller
        aborted = tuple(engine.requests)
        for request_id in aborted:
            engine.abort_request(request_id)
        engine.reset_prefix_cache()
        return StepOutcome([], aborted, e)
