"""MoERouter actor (one per stage with MoE layers): owns the stage's shard map and per-expert load
counters (exported as metrics), and in the "router" dispatch mode fans each layer's rows out to the
shards itself (see k3ray.actors.moe_dispatch for the modes)."""

from __future__ import annotations

import ray
import torch

from k3ray.actors.moe_dispatch import ShardMap, fan_out
from k3ray.actors.wire import Bundle, pack_raw, unpack, unpack_tagged


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
