"""KDA / conv state slots: live sequence states, speculative scratch slots and prefix snapshots.

A snapshot is the state after a block-aligned prefix, keyed by that prefix's chain hash. It is
`pending` from the step that copies it until that step completes, and only then `valid` (usable
by a prefix hit), so a hit can never restore a state that was not written. Valid snapshots are
evicted whenever a slot is needed, except while `pinned` by a step that reads them, in two
segments (segmented LRU): those a hit has resumed from or written at a branch point (a prefix
two prompts share) are `protected`, at most `max_protected` of them (the least recently used
demoted past it), and go after every other, so one long prompt's run of snapshots cannot
flush a shared prefix's. When the least recently used unprotected snapshot belongs to a run (the
snapshots one sequence wrote along its prompt), the run gives up the one whose loss leaves the
smallest gap instead, never its newest: a prompt longer than the slots keeps snapshots spread
along it (the spacing doubling as it grows), not only those of its last stretch.
"""

from __future__ import annotations

from collections import OrderedDict


class StatePool:
    def __init__(self, num_slots: int, max_protected: int = 0) -> None:
        self.num_slots = num_slots
        self.max_protected = max_protected
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.valid: dict[bytes, int] = {}
        self.pending: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # valid, unpinned, the rest; oldest first
        self.protected: OrderedDict[int, None] = OrderedDict()  # valid, unpinned, in `reused`; oldest first
        self.reused: set[int] = set()  # slots a completed hit resumed from or written at a branch point
        self.placed: dict[int, tuple[object, int]] = {}  # snapshot slot -> (its run, its prefix length)
        self.pins: dict[int, int] = {}

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable) + len(self.protected)

    @property
    def num_snapshots(self) -> int:
        return len(self.valid) + len(self.pending)

    @property
    def num_live(self) -> int:
        """Slots held by sequences."""
        return self.num_slots - len(self.free) - self.num_snapshots

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        segment = self.evictable or self.protected
        slot = next(iter(segment))
        if segment is self.evictable:
            slot = self._thinned(slot)
        del segment[slot]
        self.reused.discard(slot)
        self.placed.pop(slot, None)
        del self.valid[self.key_of.pop(slot)]
        return slot

    def _thinned(self, oldest: int) -> int:
        """The slot to evict in place of `oldest`: of oldest's run, the snapshot (not the newest)
        whose loss leaves the smallest gap between its neighbours, the earliest on a tie."""
        if oldest not in self.placed:
            return oldest
        run = self.placed[oldest][0]
        positions = sorted((self.placed[s][1], s) for s in self.evictable
                           if s in self.placed and self.placed[s][0] == run)
        best, best_gap = oldest, None
        for i, (_, slot) in enumerate(positions[:-1]):
            gap = positions[i + 1][0] - (positions[i - 1][0] if i else 0)
            if best_gap is None or gap < best_gap:
                best, best_gap = slot, gap
        return best

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_available, (n, self.num_available)
        return [self._take() for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        for s in slots:
            assert s not in self.key_of, f"slot {s} is a snapshot"
            self.free.append(s)

    # snapshots ------------------------------------------------------------------------------
    def lookup(self, key: bytes) -> int | None:
        return self.valid.get(key)

    def has(self, key: bytes) -> bool:
        return key in self.valid or key in self.pending

    def pin(self, slot: int) -> None:
        self.evictable.pop(slot, None)
        self.protected.pop(slot, None)
        self.pins[slot] = self.pins.get(slot, 0) + 1

    def unpin(self, slot: int, resumed: bool) -> None:
        """A step that pinned `slot` is over; `resumed`: it completed, restoring the snapshot for a hit."""
        if resumed and self.max_protected:
            self.reused.add(slot)
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            del self.pins[slot]
            self._make_evictable(slot)

    def _make_evictable(self, slot: int) -> None:
        if slot not in self.reused:
            self.evictable[slot] = None  # most recently used
            return
        self.protected[slot] = None
        if len(self.protected) > self.max_protected:  # the oldest protected goes back to the other segment
            demoted, _ = self.protected.popitem(last=False)
            self.reused.discard(demoted)
            self.evictable[demoted] = None

    def reserve_snapshot(self, key: bytes, shared: bool = False, run: object = None, position: int = 0) -> int | None:
        """A slot the coming step will copy the state for `key` into, or None if none is spare.
        `shared`: the prefix is known to be shared (a branch point), protected as if it had served a hit.
        `run`, `position`: the sequence writing it and the prefix's length in tokens (for thinning)."""
        if self.has(key) or self.num_available == 0:
            return None
        slot = self._take()
        self.pending[key] = slot
        self.key_of[slot] = key
        if run is not None:
            self.placed[slot] = (run, position)
        if shared and self.max_protected:
            self.reused.add(slot)
        return slot

    def commit_snapshot(self, slot: int) -> None:
        """The step that wrote `slot` completed: the snapshot may now serve hits."""
        key = self.key_of[slot]
        del self.pending[key]
        self.valid[key] = slot
        self._make_evictable(slot)

    def drop_snapshot(self, slot: int) -> None:
        """Forget a pending snapshot (its step did not complete)."""
        key = self.key_of.pop(slot)
        del self.pending[key]
        self.reused.discard(slot)
        self.placed.pop(slot, None)
        self.free.append(slot)

    def clear_snapshots(self) -> None:
        """Free every valid, unpinned snapshot."""
        for slot in [*self.evictable, *self.protected]:
            del self.valid[self.key_of.pop(slot)]
            self.reused.discard(slot)
            self.placed.pop(slot, None)
            self.free.append(slot)
        self.evictable.clear()
        self.protected.clear()
