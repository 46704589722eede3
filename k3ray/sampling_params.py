"""Per-request sampling settings, with vLLM's names and meanings."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

MAX_LOGPROBS = 20
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into tokens and when to stop.

    temperature 0 is greedy (top_k / top_p / min_p are then ignored); top_k -1 keeps every token;
    max_tokens None generates until the context limit; logprobs n returns the top-n log-probabilities
    (of the raw model distribution) for each generated token, prompt_logprobs n the same for every
    prompt token after the first; seed makes sampling reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        self._check_values()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self, vocab_size: int, max_model_len: int) -> None:
        """Raise ValueError if these settings cannot run on a model with this vocabulary and context."""
        self._check_values()
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        if self.max_tokens is not None and self.max_tokens >= max_model_len:
            raise ValueError(
                f"max_tokens={self.max_tokens} can never be reached: at most max_model_len - 1 = "
                f"{max_model_len - 1} tokens fit after a one-token prompt"
            )

    def _check_values(self) -> None:
        _check_int("n", self.n, low=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _check_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, low=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {value}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids entry", t, low=0)


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
