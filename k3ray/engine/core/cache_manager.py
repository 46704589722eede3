"""Cache sizing, exact accounting, and the prefix cache (hashed MLA blocks + state snapshots).

The MLA latent cache is paged in blocks of `block_size` tokens; the KDA / conv state is one slot
per sequence. Prefix caching keeps full blocks by chain hash and snapshots of the state at
block-aligned boundaries; a hit resumes at the longest prefix whose blocks are all cached and
whose snapshot was written. Snapshots are written every `snapshot_interval` blocks, at the
prompt's last full block, and where a prompt leaves the cached blocks it shares with earlier
prompts (its branch point, when that is at least a quarter interval past an interval boundary),
so the next prompt that shares that prefix resumes there. The snapshot at the branch point, or at
the interval boundary below a closer one, is protected as if it had served a hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3ray.config import ModelConfig
from k3ray.engine.config import DEFAULT_CACHE_BYTES, EngineConfig
from k3ray.engine.core.block_pool import BlockPool, hash_block
from k3ray.engine.core.sequence import Sequence
from k3ray.engine.core.state_pool import StatePool

# (model config, cache dtype) for the target, then the draft model if any: they share slot and
# block indices, so one slot or block costs the sum over models.
CacheLayout = list[tuple[ModelConfig, torch.dtype]]


@dataclass(frozen=True)
class CacheGeometry:
    num_state_slots: int
    num_blocks: int
    block_size: int


def state_slot_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """One slot: fp32 [H, K, K] recurrent state + [3 * H * K, W - 1] conv window per KDA layer."""
    H, K, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
    per_layer = H * K * K * 4 + 3 * H * K * (W - 1) * dtype.itemsize
    return len(config.kda_layer_ids) * per_layer


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return len(config.mla_layer_ids) * block_size * config.mla_latent_dim * dtype.itemsize


def size_cache(config: EngineConfig, layout: CacheLayout) -> CacheGeometry:
    """State slots for max_num_seqs sequences (+ scratch + snapshots); blocks from the budget."""
    slots = _num_state_slots(config)
    if config.num_blocks is not None:
        return CacheGeometry(slots, config.num_blocks, config.block_size)
    budget = config.cache_memory_bytes or DEFAULT_CACHE_BYTES
    slot_cost, block_cost = _costs(config, layout)
    left = budget - slots * slot_cost
    if block_cost == 0:
        raise ValueError("the model has no MLA layer; the paged cache needs at least one")
    if left < block_cost:
        raise ValueError(
            f"cache_memory_bytes={budget} does not fit {slots} state slots of {slot_cost} B plus one "
            f"MLA block of {block_cost} B; raise it or lower max_num_seqs / num_state_slots"
        )
    return CacheGeometry(slots, left // block_cost, config.block_size)


def cache_bytes_for(config: EngineConfig, layout: CacheLayout, num_tokens: int) -> int:
    """The cache_memory_bytes that size_cache turns into room for one sequence of num_tokens beside
    the long-context reserve (the engine's default max_model_len)."""
    slot_cost, block_cost = _costs(config, layout)
    spec, size = config.num_speculative_tokens, config.block_size
    blocks = -(-(num_tokens + spec) // size)
    while (short := num_tokens - (blocks * size - spec - config.reserve_tokens(blocks * size - spec))) > 0:
        blocks += -(-short // size)
    return _num_state_slots(config) * slot_cost + blocks * block_cost


def _num_state_slots(config: EngineConfig) -> int:
    min_slots = config.max_num_seqs * config.slots_per_seq
    slots = config.num_state_slots or min_slots + config.snapshot_slots
    if slots < min_slots:
        raise ValueError(
            f"num_state_slots={slots} is below max_num_seqs * slots_per_seq = {config.max_num_seqs} * "
            f"{config.slots_per_seq} = {min_slots}"
        )
    return slots


def _costs(config: EngineConfig, layout: CacheLayout) -> tuple[int, int]:
    """Bytes of one state slot and of one MLA block, summed over the layout's models."""
    slot_cost = sum(state_slot_bytes(c, d) for c, d in layout)
    return slot_cost, sum(block_bytes(c, config.block_size, d) for c, d in layout)


@dataclass
class PrefixHit:
    blocks: list[int]
    snapshot_slot: int
    num_tokens: int


class CacheManager:
    def __init__(self, geometry: CacheGeometry, layout: CacheLayout, enable_prefix_caching: bool = True,
                 snapshot_interval: int = 64, max_protected_snapshots: int = 0) -> None:
        """max_protected_snapshots: how many snapshots that served a hit or sit at a branch point outlast the
        others (StatePool)."""
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.blocks = BlockPool(geometry.num_blocks, geometry.block_size)
        self.states = StatePool(geometry.num_state_slots, max_protected_snapshots)
        self.enable_prefix_caching = enable_prefix_caching
        self.snapshot_stride = snapshot_interval * geometry.block_size
        self.slot_bytes = sum(state_slot_bytes(c, d) for c, d in layout)
        self.block_bytes = sum(block_bytes(c, geometry.block_size, d) for c, d in layout)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens resumed from the cache

    # sizes ----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def usage(self) -> dict[str, int | float]:
        g, b, s = self.geometry, self.blocks, self.states
        bytes_total = g.num_state_slots * self.slot_bytes + g.num_blocks * self.block_bytes
        bytes_used = (s.num_live + s.num_snapshots) * self.slot_bytes + b.num_used * self.block_bytes
        return {
            "blocks_total": g.num_blocks,
            "blocks_used": b.num_used,
            "blocks_cached": b.num_cached,
            "blocks_free": len(b.free),
            "block_bytes": self.block_bytes,
            "state_slots_total": g.num_state_slots,
            "state_slots_live": s.num_live,
            "state_slots_snapshot": s.num_snapshots,
            "state_slots_free": len(s.free),
            "state_slot_bytes": self.slot_bytes,
            "bytes_total": bytes_total,
            "bytes_used": bytes_used,
            "block_usage": b.num_used / g.num_blocks,
        }

    # prefix cache ----------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of seq's first num_blocks full blocks (computed once, kept on seq); a
        block's hash covers the content of the media its placeholder tokens stand for."""
        bs = self.block_size
        assert num_blocks * bs <= seq.num_tokens
        hashes = seq.block_hashes
        media = seq.request.media
        while len(hashes) < num_blocks:
            i = len(hashes)
            extra = b"" if media is None else media.block_key(i * bs, (i + 1) * bs)
            hashes.append(hash_block(hashes[-1] if hashes else b"", seq.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes[:num_blocks]

    def find_prefix(self, seq: Sequence) -> PrefixHit | None:
        """The longest cached prefix (leaving at least one token to compute) with a written snapshot.
        Where seq's cached blocks end (its branch point) sets seq's shared boundary (_shared_boundary)."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(seq, max_blocks)
        blocks = []
        for h in hashes:
            b = self.blocks.lookup(h)
            if b is None:
                break
            blocks.append(b)
        seq.shared_boundary = self._shared_boundary(len(blocks) * self.block_size)
        for n in range(len(blocks), 0, -1):
            slot = self.states.lookup(hashes[n - 1])
            if slot is not None:
                return PrefixHit(blocks[:n], slot, n * self.block_size)
        return None

    def _shared_boundary(self, branch: int) -> int:
        """The snapshot boundary that keeps the prefix two prompts share: `branch` itself if that saves a
        later prompt at least a quarter interval over the interval snapshot below it (a state slot is K3's
        whole KDA state, 414 MiB), else that interval boundary (0: none)."""
        past = branch % self.snapshot_stride
        return branch if past >= max(1, self.snapshot_stride // 4) else branch - past

    def next_boundary(self, seq: Sequence, start: int) -> int | None:
        """The first snapshot boundary after `start`: a multiple of the stride, the prompt's shared
        boundary or its last full block."""
        if not self.enable_prefix_caching:
            return None
        stride = (start // self.snapshot_stride + 1) * self.snapshot_stride
        prompt_end = seq.prompt_len // self.block_size * self.block_size
        return min([b for b in (seq.shared_boundary, prompt_end) if start < b < stride], default=stride)

    def snapshot_key(self, seq: Sequence, boundary: int) -> bytes:
        return self.block_hashes(seq, boundary // self.block_size)[-1]

    def register_blocks(self, seq: Sequence) -> None:
        """Publish seq's fully computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        n = seq.num_computed_tokens // self.block_size
        if n <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq, n)
        for i in range(seq.num_registered_blocks, n):
            self.blocks.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = n

    def resumable_prefixes(self) -> frozenset[bytes]:
        """Chain hashes of the prefixes a hit can resume from now: a written snapshot whose last
        block is still cached (what the replica reports for prefix-affinity routing)."""
        cached = self.blocks.by_hash
        return frozenset(key for key in self.states.valid if key in cached)

    def reset_prefix_cache(self) -> None:
        self.blocks.clear_cache()
        self.states.clear_snapshots()
