"""Engine settings: batching limits, cache sizing, prefix caching, speculative decoding and media."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from k3ray.vision import MediaConfig

DEFAULT_CACHE_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft `num_speculative_tokens` tokens per step and verify them in one target forward.

    method "ngram" looks the last [ngram_min, ngram_max] tokens up earlier in the sequence (prompt
    lookup); "draft" runs a smaller K3-shaped model (the executor holds it) greedily.
    """

    method: Literal["ngram", "draft"] = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and cache settings.

    Cache size: explicit `num_blocks` / `num_state_slots`, or carved from `cache_memory_bytes` (state
    slots first: one live slot per sequence, the speculative scratch slots, the snapshot slots; MLA
    blocks get the rest). `max_model_len` defaults to what the model and the block pool allow, less
    the long-context reserve.
    Prefix caching snapshots the KDA / conv state every `snapshot_interval` blocks and at the last
    block boundary of each prompt; prefill chunks end at those boundaries. On CUDA, decode-only
    steps replay CUDA graphs captured per batch-size bucket unless `enforce_eager`.

    Long context beside short requests: a sequence of more than `long_prefill_token_threshold`
    tokens is long. One long prompt prefills at a time (shorter requests go past the others), its
    chunks take at most half of what is left of a step's budget while shorter work waits, and long
    sequences together leave `long_context_reserve` tokens of the cache to the rest (None: a 16th of
    it once the cache holds four long prompts; 0: none). An explicit `max_model_len` above what the
    reserve leaves shrinks the reserve.

    Structured outputs: a JSON schema's text is at most `max_schema_bytes`; its grammar compiles in
    one of `grammar_compile_workers` worker processes, each compile within `grammar_compile_timeout_s`
    and `grammar_compile_memory_bytes` (the worker's growth), else the request fails with a
    ValueError naming the limit; compiled grammars stay in an LRU cache of `grammar_cache_bytes`
    (a grammar larger than the whole cache is refused).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    num_state_slots: int | None = None
    num_snapshot_slots: int | None = None
    cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    snapshot_interval: int = 64
    speculative: SpeculativeConfig | None = None
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs: decode steps run eagerly too (always so on the CPU)
    long_prefill_token_threshold: int = 16384
    long_context_reserve: int | None = None
    max_schema_bytes: int = 1024**2
    grammar_compile_timeout_s: float = 30.0
    grammar_compile_memory_bytes: int = 1024**3
    grammar_cache_bytes: int = 256 * 1024**2
    grammar_compile_workers: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "snapshot_interval",
                     "long_prefill_token_threshold", "max_schema_bytes", "grammar_compile_memory_bytes",
                     "grammar_cache_bytes", "grammar_compile_workers"):
            _positive(name, getattr(self, name))
        timeout = self.grammar_compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"grammar_compile_timeout_s must be a positive number, got {timeout!r}")
        for name in ("max_model_len", "num_blocks", "num_state_slots", "cache_memory_bytes"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.num_snapshot_slots is not None and (
            not isinstance(self.num_snapshot_slots, int) or self.num_snapshot_slots < 0
        ):
            raise ValueError(f"num_snapshot_slots must be an int >= 0, got {self.num_snapshot_slots!r}")
        if self.long_context_reserve is not None and (
            isinstance(self.long_context_reserve, bool) or not isinstance(self.long_context_reserve, int)
            or self.long_context_reserve < 0
        ):
            raise ValueError(f"long_context_reserve must be an int >= 0, got {self.long_context_reserve!r}")
        if self.num_blocks is not None and self.cache_memory_bytes is not None:
            raise ValueError("give num_blocks or cache_memory_bytes, not both")
        if self.max_num_batched_tokens < 1 + self.num_speculative_tokens:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one verification "
                f"(1 + num_speculative_tokens = {1 + self.num_speculative_tokens} tokens)"
            )

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def slots_per_seq(self) -> int:
        """A live KDA / conv slot, plus one scratch slot per verified position when speculating."""
        k = self.num_speculative_tokens
        return 1 + (k + 1 if k else 0)

    def reserve_tokens(self, capacity: int) -> int:
        """Cache tokens long sequences leave to the rest, of a cache holding `capacity` tokens."""
        if self.long_context_reserve is not None:
            return min(self.long_context_reserve, capacity)
        return capacity // 16 if capacity >= 4 * self.long_prefill_token_threshold else 0

    @property
    def snapshot_slots(self) -> int:
        if not self.enable_prefix_caching:
            return 0
        return self.max_num_seqs if self.num_snapshot_slots is None else self.num_snapshot_slots


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class MultiModalConfig:
    """How an engine takes media: preprocessing (None: the tower's defaults), how many items one
    prompt may hold, whether a server may fetch http(s) media URLs, and the folder file:// media URLs
    may be read from (None: none may)."""

    media: MediaConfig | None = None
    max_items_per_prompt: int = 128
    allow_remote_urls: bool = False
    fetch_timeout_s: float = 10.0
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_items_per_prompt, bool) or not isinstance(self.max_items_per_prompt, int) \
                or self.max_items_per_prompt < 1:
            raise ValueError(f"max_items_per_prompt must be a positive int, got {self.max_items_per_prompt!r}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s!r}")
        root = self.allowed_local_media_path
        if root is not None and not (isinstance(root, str) and os.path.isabs(root) and os.path.isdir(root)):
            raise ValueError(f"allowed_local_media_path must be an absolute path to a folder, got {root!r}")
