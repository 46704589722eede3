"""Benchmark requests: token-id prompts of chosen lengths, each with a fixed number of output tokens.

`random` draws prompt tokens uniformly from the tokenizer's ordinary (non-special) ids, like vLLM's
random dataset; `long` cuts prompts from the bundled public-domain corpus (each at its own offset,
so no two share a prefix the prefix cache could reuse). Lengths are uniform in
[len * (1 - range_ratio), len * (1 + range_ratio)].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3ray.evals.extra import require_eval_extra
from k3ray.evals.haystack import load_corpus

DATASETS = ("random", "long")


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    if mean < 1:
        raise ValueError(f"lengths must be >= 1, got {mean}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def random_requests(num: int, input_len: int, output_len: int, token_range: tuple[int, int],
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    low, high = token_range
    if not 0 <= low < high:
        raise ValueError(f"token_range must be [low, high) with 0 <= low < high, got {token_range}")
    rng = np.random.default_rng(seed)
    inputs = sample_lengths(rng, input_len, range_ratio, num)
    outputs = sample_lengths(rng, output_len, range_ratio, num)
    return [BenchRequest(tuple(rng.integers(low, high, size=n).tolist()), m) for n, m in zip(inputs, outputs)]


def long_requests(num: int, input_len: int, output_len: int, tokenize: Callable[[str], list[int]],
                  range_ratio: float = 0.0, seed: int = 0, corpus: str | None = None) -> list[BenchRequest]:
    require_eval_extra("--dataset long", needed=("datasets",))  # the haystack is read through `datasets`
    text = load_corpus(corpus)
    rng = np.random.default_rng(seed)
    inputs = sample_lengths(rng, input_len, range_ratio, num)
    outputs = sample_lengths(rng, output_len, range_ratio, num)
    requests = []
    for n, m in zip(inputs, outputs):
        start = int(rng.integers(0, len(text)))
        chars = 2 * n + 64
        while True:
            window = (text * (chars // len(text) + 2))[start : start + chars]
            ids = tokenize(window)
            if len(ids) >= n:
                break
            chars *= 2
        requests.append(BenchRequest(tuple(ids[:n]), m))
    return requests


def ordinary_token_range(tokenizer_info: dict) -> tuple[int, int]:
    """[0, first special id): ids below every special token are ordinary text in K3's tokenizers."""
    specials = [tokenizer_info.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    specials += list(tokenizer_info.get("stop_token_ids") or [])
    specials = [int(s) for s in specials if isinstance(s, int)]
    high = min(specials) if specials else int(tokenizer_info.get("vocab_size") or 0)
    if high < 2:
        raise ValueError(f"cannot tell the ordinary token ids from /tokenizer_info: {tokenizer_info}")
    return 0, high
