"""Speculative decoding: prompt-lookup drafts, and verification of k drafts from one target forward.

The drafts are deterministic (prompt lookup, or the draft model's argmax), so verification is
speculative sampling with a one-hot draft distribution: draft d at position i is accepted with
probability p_i(d); on rejection the token is drawn from p_i with d removed; after k acceptances
a bonus token is drawn from p_k. The output has the target's distribution, and under greedy
parameters it is exactly the target's greedy continuation.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from k3ray.engine.core.sequence import Sequence
from k3ray.engine.sample.sampler import draw, sampling_probs, uniform
from k3ray.sampling_params import SamplingParams


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from ngram_max down
    to ngram_min) and propose the tokens that followed it."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        # per sequence: (buffer, filled length); tokens are only ever appended
        self._buffers: weakref.WeakKeyDictionary[Sequence, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    def _tokens(self, seq: Sequence) -> np.ndarray:
        buf, n = self._buffers.get(seq, (np.zeros(0, dtype=np.int64), 0))
        if seq.num_tokens > buf.size:
            grown = np.zeros(max(2 * buf.size, seq.num_tokens, 64), dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if seq.num_tokens > n:
            buf[n : seq.num_tokens] = seq.token_ids[n:]
        self._buffers[seq] = (buf, seq.num_tokens)
        return buf[: seq.num_tokens]

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        return lookup(self._tokens(seq), k, self.ngram_min, self.ngram_max)


def lookup(tokens: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens of `tokens`."""
    L = tokens.size
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # starts 0 .. L - 1 - n
        hits = np.flatnonzero((windows == tokens[L - n :]).all(1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [len(drafts) + 1, V] from feeding (last token, *drafts) -> the accepted drafts
    followed by one target token (a correction, or the bonus token if every draft is accepted).
    The math runs on the logits' device; the acceptance test compares host uniforms with p_i(d_i)."""
    if params.greedy:
        target = logits.argmax(-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if target[i] != d:
                return out + [target[i]]
            out.append(d)
        return out + [target[len(drafts)]]
    probs = sampling_probs(logits, params)  # [k + 1, V] on the logits' device
    rows = torch.arange(len(drafts))
    accept = probs[rows.to(probs.device), torch.tensor(drafts).to(probs.device)].tolist()  # p_i(d_i), one copy
    out = []
    for i, d in enumerate(drafts):
        if uniform(generator) < accept[i]:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        return out + [draw(residual, generator)]
    return out + [draw(probs[len(drafts)], generator)]
