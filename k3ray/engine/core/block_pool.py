"""The paged MLA latent-cache blocks: reference counts, prefix hashes and LRU eviction.

A block is in exactly one of three states: referenced (ref > 0), cached (ref == 0 with a hash:
reusable by a prefix hit until evicted, least recently freed first) or free (ref == 0, no hash).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Chain hash of a full block: identifies the block's tokens (and `extra`, e.g. the media its
    placeholder tokens stand for) and everything before it."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes() + extra, digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_available, (n, self.num_available)
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.cached.popitem(last=False)
                del self.by_hash[self.hash[b]]
                self.hash[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference each; the tail goes first so a chain's head is evicted last."""
        for b in reversed(blocks):
            assert self.ref[b] > 0, f"block {b} released twice"
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    self.free.append(b)
                else:
                    self.cached[b] = None

    def lookup(self, block_hash: bytes) -> int | None:
        return self.by_hash.get(block_hash)

    def acquire(self, b: int) -> None:
        """Take a reference on a cached block (a prefix hit)."""
        if self.ref[b] == 0:
            del self.cached[b]
        self.ref[b] += 1

    def register(self, b: int, block_hash: bytes) -> None:
        """Publish a fully written block; a hash another block already holds keeps that block."""
        assert self.ref[b] > 0
        if self.hash[b] is None and block_hash not in self.by_hash:
            self.hash[b] = block_hash
            self.by_hash[block_hash] = b

    def clear_cache(self) -> None:
        """Forget every hash (referenced blocks stay allocated)."""
        for b in list(self.by_hash.values()):
            self.hash[b] = None
        self.by_hash.clear()
        self.free.extend(self.cached)
        self.cached.clear()
