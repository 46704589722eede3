"""Requests and their sequences (one per sample when n > 1).

A sequence's tokens are `token_ids` (prompt, then output); the first `num_computed_tokens` of
them are in the caches. Decode and prefill are the same thing: feed tokens
[num_computed_tokens, num_tokens), and sample once all of them are computed. The cache fields
(state_slot, spec_slots, block_table, num_registered_blocks) belong to the Scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import replace

import torch

from k3ray.engine.media.prompt_media import PromptMedia
from k3ray.engine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from k3ray.sampling_params import RequestOutputKind, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, request: "Request", index: int, generator: torch.Generator | None,
                 detokenizer=None) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.params: SamplingParams = request.params
        self.prompt_len = len(request.prompt_token_ids)
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.generator = generator
        self.detokenizer = detokenizer
        self.text_parts: list[str] = []  # the text a stream may show, appended to only
        self.held_text = ""  # the text after it that may be the start of a stop string
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[PositionLogprobs] | None = [] if self.params.logprobs is not None else None
        self.grammar = None  # a GrammarState when the output is constrained (structured outputs)
        # how much of it the request's delta outputs have carried
        self.num_tokens_sent = 0
        self.num_text_parts_sent = 0
        self.finish_sent = False
        # cache bookkeeping (Scheduler)
        self.state_slot: int | None = None
        self.spec_slots: list[int] = []
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.shared_boundary = 0  # its shared prefix's snapshot boundary at its last lookup (CacheManager)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def completion(self) -> CompletionOutput:
        """Everything so far (O(length): built only for a caller that asked for cumulative outputs)."""
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=self.output_token_ids,
            cumulative_logprob=None if self.output_logprobs is None else self.cumulative_logprob,
            logprobs=None if self.output_logprobs is None else list(self.output_logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def delta(self) -> CompletionOutput | None:
        """What is new since the previous delta (None: nothing), marked sent: O(what is new)."""
        new_ids = self.token_ids[self.prompt_len + self.num_tokens_sent :]
        newly_finished = self.finished and not self.finish_sent
        if not new_ids and len(self.text_parts) == self.num_text_parts_sent and not newly_finished:
            return None
        logprobs = None if self.output_logprobs is None else self.output_logprobs[self.num_tokens_sent :]
        text = "".join(self.text_parts[self.num_text_parts_sent :])
        self.num_tokens_sent += len(new_ids)
        self.num_text_parts_sent = len(self.text_parts)
        self.finish_sent = self.finished
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=new_ids,
            cumulative_logprob=None if self.output_logprobs is None else self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, media: PromptMedia | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.media = media  # images / videos behind the prompt's placeholder tokens
        self.grammar = None  # the GrammarJob compiling its structured outputs' grammar
        self.params = params
        self.metrics = RequestMetrics(arrival_time)
        self.seqs: list[Sequence] = []
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_prompt_logprobs_sent = 0  # by delta outputs
        # prefill/decode disaggregation (k3ray/engine/disagg/handoff.py)
        self.export_from: int | None = None  # prefill only: hand off the caches from this prompt token on
        self.export_parts = False  # prefill only: send each chunk's latent rows as it computes them
        self.rows_sent: int | None = None  # prefill only: the latent rows before this one went out in parts
        self.handoff_parts_out: list = []  # prefill only: HandoffParts made since the previous output
        self.handoff_in = None  # decode: the Handoff to continue from, until it is written into the caches
        self.handoff_out = None  # prefill: the Handoff made once the first token is sampled

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def output_of_kind(self, finished: bool) -> RequestOutput | None:
        """The output its params.output_kind asks for now (None: nothing to send); `finished`: the
        request's, as the caller just read it (a step reads it once per request)."""
        kind = self.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY:
            return self.output() if finished else None
        return self.delta_output() if kind is RequestOutputKind.DELTA else self.output()

    def delta_output(self) -> RequestOutput | None:
        """What changed since the previous delta: new tokens, text and logprobs of the sequences that
        advanced or finished (with best_of > n, none until all finish, then the n best)."""
        if self.params.num_sequences != self.params.n:
            return self.output()
        completions = [d for d in (s.delta() for s in self.seqs) if d is not None]
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = self.prompt_logprobs[self.num_prompt_logprobs_sent :]
            self.num_prompt_logprobs_sent = len(self.prompt_logprobs)
        if not completions and not prompt_logprobs and not self.finished and not self.handoff_parts_out:
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=self.finished,
            metrics=self.metrics,
            handoff=self.handoff_out,
            handoff_parts=self._take_parts(),
        )

    def _take_parts(self) -> list:
        parts, self.handoff_parts_out = self.handoff_parts_out, []
        return parts

    def output(self) -> RequestOutput:
        """Everything so far (cumulative)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            outputs=self._completions(),
            finished=self.finished,
            metrics=self.metrics,
            handoff=self.handoff_out,
        )

    def _completions(self) -> list[CompletionOutput]:
        """Every sequence's; with best_of > n, nothing until all finish, then the n with the highest
        cumulative log-probability, best first, indexed 0..n-1."""
        if self.params.num_sequences == self.params.n:
            return [s.completion() for s in self.seqs]
        if not self.finished:
            return []
        best = sorted(self.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: self.params.n]
        return [replace(s.completion(), index=i) for i, s in enumerate(best)]
