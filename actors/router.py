"""MoE Router actor (one per stage): fans a step's latent rows out to the expert shards — one
batched call per shard per layer, carrying only the rows routed to that shard — sums the partial
outputs and keeps per-expert load counters."""

from __future__ import annotations

import ray
import torch

from k3ray.actors.wire import Bundle, pack, unpack


class MoERouter:
    def __init__(self, shards: list[tuple[int, int, "ray.actor.ActorHandle"]], num_experts: int,
                 call_timeout_s: float, torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        self.shards = shards  # (e0, e1, handle), covering [0, num_experts)
        self.timeout = call_timeout_s
        self.load = torch.zeros(num_experts, dtype=torch.long)  # routed (token, expert) pairs
        self.calls = 0

    @torch.no_grad()
    def dispatch(self, layer_idx: int, rows: Bundle) -> Bundle:
        """rows = (h [T, Dl], ids [T, k], weights [T, k]) -> (y [T, Dl] fp32,), summed over the shards."""
        h, ids, weights = unpack(rows)
        pending = []
        for e0, e1, shard in self.shards:
            rows = ((ids >= e0) & (ids < e1)).any(-1).nonzero().squeeze(-1)  # [T_s]
            if rows.numel():
                pending.append((rows, shard.compute.remote(layer_idx, pack(h[rows], ids[rows], weights[rows]))))
        y = torch.zeros(h.shape, dtype=torch.float32)
        if pending:
            parts = ray.get([ref for _, ref in pending], timeout=self.timeout)
            for (rows, _), part in zip(pending, parts):
                y.index_add_(0, rows, unpack(part)[0])
        self.load += torch.bincount(ids.flatten(), minlength=self.load.numel())
        self.calls += 1
        return pack(y)

    def expert_load(self) -> list[int]:
        return self.load.tolist()

    def ready(self) -> dict:
        return {"shards": [(e0, e1) for e0, e1, _ in self.shards],
                "node_id": ray.get_runtime_context().get_node_id()}
