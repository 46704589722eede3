"""Prefix-affinity replica routing: a request goes to the replica whose prefix cache holds the
longest leading part of its prompt, so the turns of a conversation (and prompts that share a
prefix) resume from one replica's cache instead of hitting it 1/N of the time.

    K3Server.options(request_router_config=affinity_router_config(args))   # serve/app.py

The request's prefix is the engine's own chain hashes of its full token blocks (block_pool.hash_block,
computed by the ingress router, serve/ingress_routing.py). What each replica holds comes from two places:
- the replica's report (K3Server.record_routing_stats, pulled by Serve's controller every
  routing_stats_period_s): the chain hashes its cache can resume from, i.e. written KDA / conv
  snapshots whose MLA block is still cached (CacheManager.resumable_prefixes);
- between reports, where this router sent each prompt: the block boundaries that replica snapshots
  (every snapshot_interval blocks and the prompt's last full block), forgotten after provisional_ttl_s.
Only some replicas' queues are probed when there are more than PROBE_ALL: those with the deepest
match (at most MATCH_PROBES, by chance) and PROBE_OTHERS more by chance, as Serve's power-of-two
router does; the held prefixes are read without copying them. The target is the replica with the
longest match, when that covers at least half the prompt's blocks. It is passed over for the
least-loaded replica when it is full or its queue (Serve's ongoing requests, probed) exceeds the
least-loaded one's by more than max_imbalance. A prompt that matches nothing (or only a shared
preamble) goes to the least-loaded replica, ties to the one holding fewer prefixes (so unrelated
conversations spread).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence, Set

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

PREFIXES_STAT = "k3ray_resumable_prefixes"  # routing_stats key: the replica's resumable chain hashes
HASHES_KWARG = "prefix_hashes"  # choose_replica kwarg: the request's block chain hashes, in order
DEFAULT_MAX_IMBALANCE = 4
DEFAULT_PROVISIONAL_TTL_S = 30.0
PROVISIONAL_LIMIT = 65536  # remembered hashes per replica, oldest dropped first
PROBE_ALL = 4  # up to this many replicas, every queue is probed
# a match must cover this much of the prompt to pin it (SGLang's cache_threshold): prompts that share
# only a preamble (K3's tool declarations and effort statement) spread by load
MIN_MATCH_FRACTION = 0.5
MATCH_PROBES, PROBE_OTHERS = 2, 2  # past it: the deepest matches, then others by chance


def match_depth(chain: Sequence[bytes], held: Set[bytes]) -> int:
    """How many leading blocks of `chain` a replica holding `held` resumes from (0: none)."""
    for i in range(len(chain) - 1, -1, -1):
        if chain[i] in held:
            return i + 1
    return 0


def deepest_matches(chain: Sequence[bytes], held: Mapping[Hashable, Set[bytes]],
                    replicas: Iterable[Hashable], min_fraction: float = 0.0) -> list[Hashable]:
    """The replicas holding the longest leading part of `chain` (none if no replica holds any, or
    the longest covers less than min_fraction of the chain)."""
    depth = {r: match_depth(chain, held.get(r, frozenset())) for r in replicas}
    deepest = max(depth.values(), default=0)
    if deepest < min_fraction * len(chain):
        return []
    return [r for r in depth if deepest and depth[r] == deepest]


def pick_replica(chain: Sequence[bytes], held: Mapping[Hashable, Set[bytes]], queue: Mapping[Hashable, int],
                 capacity: Mapping[Hashable, int], max_imbalance: int, rng: random.Random = random) -> Hashable:
    """The replica for a request whose block chain is `chain`: the longest match unless it is full
    (while another is not) or more than max_imbalance requests behind the least loaded, else the
    least loaded (ties: fewer prefixes held, then chance). `queue` holds the replicas that answered a
    probe (all are candidates); `held` and `capacity` cover at least those."""
    assert queue, "no replica to choose from"
    least = min(queue.values())
    room = any(queue[r] < capacity[r] for r in queue)  # all full: the request queues wherever it goes

    def free(r) -> bool:
        return (queue[r] < capacity[r] or not room) and queue[r] - least <= max_imbalance

    affine = [r for r in deepest_matches(chain, held, queue, MIN_MATCH_FRACTION) if free(r)]
    pool = affine or list(queue)
    return min(pool, key=lambda r: (queue[r], len(held.get(r, ())), rng.random()))


def probe_targets(chain: Sequence[bytes], held: Mapping[Hashable, Set[bytes]], replicas: Sequence[Hashable],
                  rng: random.Random = random) -> list[Hashable]:
    """The replicas whose queues a request probes: all of up to PROBE_ALL, else up to MATCH_PROBES of
    those with the deepest match (by chance among them) and PROBE_OTHERS of the rest (by chance)."""
    if len(replicas) <= PROBE_ALL:
        return list(replicas)
    matched = deepest_matches(chain, held, replicas)
    picked = rng.sample(matched, min(MATCH_PROBES, len(matched)))
    others = [r for r in replicas if r not in picked]
    return picked + rng.sample(others, min(PROBE_OTHERS, len(others)))


class HeldPrefixes(Set):
    """A replica's resumable hashes: its last report and, unexpired, where this router sent prompts;
    read in place (a per-request union would copy up to PROVISIONAL_LIMIT hashes per replica)."""

    def __init__(self, reported: Set[bytes], sent: Mapping[bytes, float]):
        self.reported, self.sent = reported, sent

    def __contains__(self, h: object) -> bool:
        return h in self.reported or h in self.sent

    def __iter__(self):
        yield from self.reported
        yield from (h for h in self.sent if h not in self.reported)

    def __len__(self) -> int:  # the tie-break's size: both parts, overlaps counted twice
        return len(self.reported) + len(self.sent)


def snapshot_boundaries(chain: Sequence[bytes], snapshot_interval: int) -> list[bytes]:
    """The hashes of `chain` the engine snapshots when it runs the prompt: every snapshot_interval
    blocks and the last full block (CacheManager.next_boundary)."""
    picked = [h for i, h in enumerate(chain) if (i + 1) % snapshot_interval == 0]
    if chain and (not picked or picked[-1] != chain[-1]):
        picked.append(chain[-1])
    return picked


class PrefixAffinityRequestRouter(RequestRouter):
    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, snapshot_interval: int = 64,
                         provisional_ttl_s: float = DEFAULT_PROVISIONAL_TTL_S) -> None:
        self.max_imbalance = max_imbalance
        self.snapshot_interval = snapshot_interval
        self.provisional_ttl_s = provisional_ttl_s
        self._sent: dict[ReplicaID, OrderedDict[bytes, float]] = {}  # hash -> when it was sent there
        self._reported: dict[ReplicaID, tuple[object, frozenset[bytes]]] = {}  # the report as received, as a set

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """One replica, in a rank of its own (with `_reserve=False` Serve takes the first as is)."""
        if not candidate_replicas:
            return []
        chain = list((pending_request.kwargs.get(HASHES_KWARG) if pending_request else None) or ())
        by_id = {r.replica_id: r for r in candidate_replicas}
        held = {rid: self._held(replica) for rid, replica in by_id.items()}
        targets = [by_id[rid] for rid in probe_targets(chain, held, list(by_id))]
        probed = await self._probe_queue_lens(targets, 0)
        queue = {r.replica_id: n for r, n in probed if n is not None}
        if not queue:  # no replica answered in time: route on the prefix alone
            queue = {r.replica_id: 0 for r in targets}
        capacity = {rid: by_id[rid].max_ongoing_requests for rid in queue}
        chosen = pick_replica(chain, held, queue, capacity, self.max_imbalance)
        self._remember(chosen, snapshot_boundaries(chain, self.snapshot_interval))
        return [[by_id[chosen]]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for table in (self._sent, self._reported):
            for gone in set(table) - live:
                del table[gone]

    def _held(self, replica: RunningReplica) -> HeldPrefixes:
        report = replica.routing_stats.get(PREFIXES_STAT, ())
        seen = self._reported.get(replica.replica_id)
        if seen is None or seen[0] is not report:  # a new report: made a set once, not per request
            seen = self._reported[replica.replica_id] = (report, frozenset(report))
        sent = self._sent.get(replica.replica_id, {})
        horizon = time.monotonic() - self.provisional_ttl_s
        while sent and next(iter(sent.values())) < horizon:
            sent.popitem(last=False)
        return HeldPrefixes(seen[1], sent)

    def _remember(self, replica_id: ReplicaID, hashes: list[bytes]) -> None:
        sent = self._sent.setdefault(replica_id, OrderedDict())
        now = time.monotonic()
        for h in hashes:
            sent.pop(h, None)
            sent[h] = now
        while len(sent) > PROVISIONAL_LIMIT:
            sent.popitem(last=False)
