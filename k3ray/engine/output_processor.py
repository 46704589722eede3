"""Appending sampled tokens to a sequence: logprobs, streaming text, and every stop condition."""

from __future__ import annotations

import time

from k3ray.engine.core.sequence import Sequence, SequenceStatus
from k3ray.engine.outputs import PositionLogprobs
from k3ray.tokenizer import IncrementalDetokenizer, stop_prefix_len, truncate_at_stop


class OutputProcessor:
    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int, tokenizer=None) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def new_detokenizer(self, skip_special_tokens: bool):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)

    def append(self, seq: Sequence, token: int, logprobs: PositionLogprobs | None) -> bool:
        """Add one generated token; True if it finished the sequence."""
        params = seq.params
        seq.token_ids.append(token)
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.monotonic()
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[token].logprob
            if seq.output_logprobs is not None:
                seq.output_logprobs.append(logprobs)
        if not params.ignore_eos and token in self.eos_token_ids:
            return self._finish(seq, "stop", None)
        if token in params.stop_token_ids:
            return self._finish(seq, "stop", token)
        if seq.detokenizer is not None and self._push_text(seq, token):
            return True
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return self._finish(seq, "length", None)
        if seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length", None)
        return False

    def _push_text(self, seq: Sequence, token: int) -> bool:
        """Stream the token's text; a stop string ends the sequence and is cut from the text. Only
        the held-back tail (shorter than the longest stop string) and the new piece are searched:
        text already released cannot hold the start of a stop."""
        params = seq.params
        piece = seq.detokenizer.push(token)
        if not params.stop:
            _release(seq, piece)
            return False
        tail = seq.held_text + piece
        kept, stop = truncate_at_stop(tail, params.stop)
        if stop is not None:
            seq.held_text = ""
            _release(seq, kept + (stop if params.include_stop_str_in_output else ""))
            return self._finish(seq, "stop", stop, flush=False)
        held = stop_prefix_len(tail, params.stop)
        seq.held_text = tail[len(tail) - held :]
        _release(seq, tail[: len(tail) - held])
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None, flush: bool = True) -> bool:
        if flush and seq.detokenizer is not None:
            _release(seq, seq.held_text + seq.detokenizer.flush())
            seq.held_text = ""
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED
        return True

    def abort(self, seq: Sequence) -> None:
        self._finish(seq, "abort", None)

    def hand_off(self, seq: Sequence) -> None:
        """A prefill-only sequence ends at its first token: a decode engine continues it."""
        self._finish(seq, "handoff", None)


def _release(seq: Sequence, text: str) -> None:
    if text:
        seq.text_parts.append(text)
