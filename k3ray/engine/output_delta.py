"""RequestOutputs as deltas between processes: the engine's outputs are cumulative (every token,
the prompt, its logprobs), so sending them whole each step costs O(length) per request per step;
the encoder sends only what changed since the request's last output and the decoder rebuilds the
cumulative RequestOutput on the other side.

    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    same = decoder.decode(encoder.encode(out))   # == out, field for field

Text normally only grows, but a stop string found at the end is cut from it, so a text delta is
(characters kept, characters appended).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from k3ray.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass(frozen=True)
class CompletionDelta:
    index: int
    text_kept: int  # characters of the previous text that stay
    text_added: str
    new_token_ids: list[int]
    new_logprobs: list | None  # None: the completion has no logprobs
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(frozen=True)
class OutputDelta:
    request_id: str
    finished: bool
    metrics: RequestMetrics
    completions: list[CompletionDelta]
    new_prompt_logprobs: list | None  # None: no prompt logprobs (yet)
    # the request's first delta only
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class _Sent:
    """What the other side holds for one completion."""

    text: str = ""
    num_tokens: int = 0


@dataclass
class _Request:
    completions: dict[int, _Sent] = field(default_factory=dict)
    num_prompt_logprobs: int = 0


class DeltaEncoder:
    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        first = out.request_id not in self._requests
        state = self._requests.setdefault(out.request_id, _Request())
        completions = [self._completion(state.completions.setdefault(c.index, _Sent()), c) for c in out.outputs]
        new_prompt_logprobs = None
        if out.prompt_logprobs is not None:
            new_prompt_logprobs = out.prompt_logprobs[state.num_prompt_logprobs:]
            state.num_prompt_logprobs = len(out.prompt_logprobs)
        if out.finished:
            del self._requests[out.request_id]
        return OutputDelta(
            request_id=out.request_id, finished=out.finished, metrics=out.metrics, completions=completions,
            new_prompt_logprobs=new_prompt_logprobs,
            prompt=out.prompt if first else None, prompt_token_ids=out.prompt_token_ids if first else None,
        )

    def forget(self, request_id: str) -> None:
        """The request ended without a finished output (it failed)."""
        self._requests.pop(request_id, None)

    @staticmethod
    def _completion(sent: _Sent, c: CompletionOutput) -> CompletionDelta:
        assert len(c.token_ids) >= sent.num_tokens, "a completion's tokens only grow"
        kept = len(sent.text) if c.text.startswith(sent.text) else len(os.path.commonprefix([sent.text, c.text]))
        delta = CompletionDelta(
            index=c.index, text_kept=kept, text_added=c.text[kept:], new_token_ids=c.token_ids[sent.num_tokens:],
            new_logprobs=None if c.logprobs is None else c.logprobs[sent.num_tokens:],
            cumulative_logprob=c.cumulative_logprob, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        )
        sent.text, sent.num_tokens = c.text, len(c.token_ids)
        return delta


class DeltaDecoder:
    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        """A new RequestOutput (earlier ones handed out are never changed)."""
        previous = self._outputs.get(delta.request_id)
        if previous is None:
            assert delta.prompt_token_ids is not None, f"the first delta of {delta.request_id!r} lacks its prompt"
            previous = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, None, [], False)
        prompt_logprobs = previous.prompt_logprobs
        if delta.new_prompt_logprobs is not None:
            prompt_logprobs = (prompt_logprobs or []) + delta.new_prompt_logprobs
        by_index = {c.index: c for c in previous.outputs}
        outputs = [_apply(by_index.get(d.index), d) for d in delta.completions]
        out = RequestOutput(delta.request_id, previous.prompt, previous.prompt_token_ids, prompt_logprobs, outputs,
                            delta.finished, delta.metrics)
        if delta.finished:
            self._outputs.pop(delta.request_id, None)
        else:
            self._outputs[delta.request_id] = out
        return out

    def forget(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)


def _apply(previous: CompletionOutput | None, d: CompletionDelta) -> CompletionOutput:
    text = "" if previous is None else previous.text
    token_ids = [] if previous is None else previous.token_ids
    logprobs = None if d.new_logprobs is None else ((previous.logprobs or []) if previous else []) + d.new_logprobs
    return CompletionOutput(
        index=d.index, text=text[:d.text_kept] + d.text_added, token_ids=token_ids + d.new_token_ids,
        cumulative_logprob=d.cumulative_logprob, logprobs=logprobs, finish_reason=d.finish_reason,
        stop_reason=d.stop_reason,
    )
