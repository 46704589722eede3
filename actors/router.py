"""MoE dispatch over expert-shard actors: one batched call per shard per layer, carrying the rows
routed to that shard (a small step's rows go whole to every shard they touch), partial outputs
summed.

The MoERouter actor (one per stage) owns a stage's shard map and per-expert load counters. With
ParallelConfig.moe_dispatch = "direct" (the default) the stage fans out to the router's shards
itself and reports its load counts to the router once per step; with "router" every MoE layer's
rows go stage -> router -> shards -> router -> stage (one more actor call in series per layer:
~2 ms more here); "compiled" is "direct" through a Ray Compiled Graph over the shards (stage.py)."""

from __future__ import annotations

import ray
import torch

from k3ray.actors.wire import Bundle, pack, pack_raw, sum_raw, unpack, unpack_raw, unpack_tagged

ShardMap = list[tuple[int, int, "ray.actor.ActorHandle"]]  # (e0, e1, shard), covering [0, num_experts)


def routed_to(ids: torch.Tensor, e0: int, e1: int) -> torch.Tensor:
    """ids [T, k] -> [T, k] bool: which routed experts lie in [e0, e1)."""
    return (ids >= e0) & (ids < e1)


def shard_rows(ids: torch.Tensor, e0: int, e1: int) -> torch.Tensor:
    """ids [T, k] -> [T_s]: the rows with at least one expert in [e0, e1)."""
    return routed_to(ids, e0, e1).any(-1).nonzero().squeeze(-1)


# rows up to this size go whole to each shard: one pack and a plain sum instead of a row selection,
# a pack and an index_add per shard (with packing before sending: -0.35 to -0.4 ms per decode
# dispatch here, interleaved A/B); above it each shard gets only its rows, so traffic does not grow
# with the shard count
BROADCAST_BYTES = 64 << 10


def split(shards: ShardMap, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
          every_shard: bool = False) -> tuple[list, list[Bundle], list[torch.Tensor] | None]:
    """The calls of one layer's dispatch: (target shards, one bundle each tagged with the layer,
    rows [T_s] per target or None when each target gets the whole step). A shard none of the rows
    is routed to is left out unless every_shard (a compiled graph runs all its nodes)."""
    if h.numel() * h.element_size() <= BROADCAST_BYTES:
        bundle = pack(h, ids, weights, tag=layer_idx)
        if every_shard:
            targets = [shard for _, _, shard in shards]
        else:  # a decode step's few ids: a Python set is cheaper here than a mask per shard
            present = set(ids.flatten().tolist())
            targets = [shard for e0, e1, shard in shards if any(e0 <= e < e1 for e in present)]
        return targets, [bundle] * len(targets), None
    rows, bundles, targets = [], [], []
    for e0, e1, shard in shards:
        r = shard_rows(ids, e0, e1)  # [T_s]
        if r.numel() or every_shard:
            rows.append(r)
            bundles.append(pack(h[r], ids[r], weights[r], tag=layer_idx))
            targets.append(shard)
    return targets, bundles, rows


def combine(shape: torch.Size, rows: list[torch.Tensor] | None, parts: list) -> torch.Tensor:
    """Sum the shards' partial outputs (raw fp32, one per target of split: rows[s] of y each or
    the whole step) -> y [T, Dl] fp32."""
    if rows is None and parts:
        return sum_raw(parts, torch.float32, shape)
    y = torch.zeros(shape, dtype=torch.float32)
    for r, part in zip(rows or [], parts):
        y.index_add_(0, r, unpack_raw(part, torch.float32, (r.numel(), shape[1])))
    return y


def fan_out(shards: ShardMap, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            timeout_s: float) -> torch.Tensor:
    """h [T, Dl], ids / weights [T, k] -> y [T, Dl] fp32: every shard with an expert of some row
    computes those rows' experts in its range (other ids add 0); the calls run concurrently."""
    # every bundle is packed before the first call goes out: packing between submissions competed
    # with Ray's sending threads and the first shard for the 2 cores
    targets, bundles, rows = split(shards, layer_idx, h, ids, weights)
    refs = [shard.compute.remote(bundle) for shard, bundle in zip(targets, bundles)]
    return combine(h.shape, rows, ray.get(refs, timeout=timeout_s) if refs else [])


class MoERouter:
    def __init__(self, shards: ShardMap, num_experts: int, call_timeout_s: float, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        self.shards = shards
        self.timeout = call_timeout_s
        self.load = torch.zeros(num_experts, dtype=torch.long)  # routed (token, expert) pairs
        self.calls = 0

    @ray.method(enable_task_events=False)  # per layer, as ExpertShard.compute
    @torch.inference_mode()
    def dispatch(self, rows: Bundle) -> bytes:
        """rows = (h [T, Dl], ids [T, k], weights [T, k]) tagged with the layer -> y [T, Dl] fp32
        summed over the shards, raw (wire.pack_raw)."""
        layer_idx, (h, ids, weights) = unpack_tagged(rows)
        y = fan_out(self.shards, layer_idx, h, ids, weights, self.timeout)
        self.load += torch.bincount(ids.flatten(), minlength=self.load.numel())
        self.calls += 1
        return pack_raw(y)

    def shard_map(self) -> ShardMap:
        """What a stage dispatching directly calls."""
        return self.shards

    def record_load(self, counts: Bundle, dispatches: int) -> None:
        """Load counts of a stage's direct dispatches (sent once per step, not awaited)."""
        self.load += unpack(counts)[0]
        self.calls += dispatches

    def expert_load(self) -> list[int]:
        return self.load.tolist()

    def ready(self) -> dict:
        return {"shards": [(e0, e1) for e0, e1, _ in self.shards],
                "node_id": ray.get_runtime_context().get_node_id()}
