"""MoERouter actor (one per stage with MoE layers): owns the stage's shard map, per-expert load
counters (exported as metrics) and expert placement, and in the "router" dispatch mode fans each
layer's rows out to the shards itself (see k3ray.actors.moe_dispatch for the modes).

Balancing (expert_placement.py): every `rebalance_steps` steps (or on `rebalance()`) the router
places replicas of the hottest experts of the last window on the least-loaded shards, at most
`redundant_experts` per shard; the shards load them in the background, and only once all hold
theirs does the router offer the new placement, which the stage takes up between two steps. The
replicas of the previous placement are dropped once the stage reports the new one in use."""

from __future__ import annotations

import ray
import torch

from k3ray.actors.expert_placement import Placement, balance, max_over_mean
from k3ray.actors.moe_dispatch import ShardMap, fan_out
from k3ray.actors.protocol import StageFailure
from k3ray.actors.restartable import Restartable
from k3ray.actors.wire import Bundle, pack_raw, unpack, unpack_tagged


class MoERouter(Restartable):
    def __init__(self, shards: ShardMap, num_experts: int, call_timeout_s: float, torch_threads: int = 1,
                 redundant_experts: int = 0, rebalance_steps: int = 0):
        torch.set_num_threads(torch_threads)
        self.shards = shards
        self.timeout = call_timeout_s
        self.load = torch.zeros(num_experts, dtype=torch.long)  # routed (token, expert) pairs
        self.calls = 0
        self.redundant_experts, self.rebalance_steps = redundant_experts, rebalance_steps
        self.placement = Placement.static([(e0, e1) for e0, e1, _ in shards])  # offered to the stage
        self.pending: Placement | None = None  # computed; its replicas still loading
        self.in_use = 0  # the placement version the stage last reported
        self.window_start = self.load.clone()  # load counts at the last rebalance
        self.steps = 0
        self.dropped = 0  # the last version whose stale replicas were dropped
        self.replicated_placements = 0  # placements with replicas taken up so far

    @ray.method(enable_task_events=False)  # per layer, as ExpertShard.compute
    @torch.inference_mode()
    def dispatch(self, rows: Bundle) -> bytes:
        """rows = (h [T, Dl], ids [T, k], weights [T, k]) tagged with the layer -> y [T, Dl] fp32
        summed over the shards, raw (wire.pack_raw)."""
        layer_idx, (h, ids, weights) = unpack_tagged(rows)
        try:
            y = fan_out(self.shards, layer_idx, h, ids, weights, self.timeout, self.placement)
        except Exception:
            if self.placement.replicated:
                self.restore_replicas()
            raise
        self.load += torch.bincount(ids.flatten(), minlength=self.load.numel())
        self.calls += 1
        return pack_raw(y)

    def end_step(self) -> None:
        """Router dispatch: a step ended; a ready placement takes effect from the next step (the
        router handles its calls in order, so between this step's last dispatch and the next's first)."""
        self._step_done()
        self.in_use = self.placement.version
        self._drop_stale_replicas()

    def shard_map(self) -> ShardMap:
        """What a stage dispatching directly calls."""
        return self.shards

    def record_load(self, counts: Bundle, dispatches: int, version: int = 0) -> Placement | None:
        """Load counts of a stage's direct dispatches (sent once per step, not awaited) with the
        placement version it used -> a newer placement to take up before its next step, or None.
        Raises until the runner takes a restarted router back: the stage's placement is not its own."""
        if self.restarted:
            raise StageFailure("the MoE router was restarted: it lost the placement the stage uses")
        self.load += unpack(counts)[0]
        self.calls += dispatches
        self.in_use = version
        self._step_done()
        self._drop_stale_replicas()
        return self.placement if self.placement.version > version else None

    def _step_done(self) -> None:
        self.steps += 1
        if self.rebalance_steps and self.steps % self.rebalance_steps == 0 and self.pending is None:
            self.rebalance()
        if self.pending is not None and self._replicas_loaded(self.pending):
            self.placement, self.pending = self.pending, None
            self.replicated_placements += self.placement.replicated

    def _replicas_loaded(self, placement: Placement) -> bool:
        held = ray.get([shard.held_replicas.remote() for _, _, shard in self.shards], timeout=self.timeout)
        return all(set(want) <= set(have) for want, have in zip(placement.replicas, held))

    def _drop_stale_replicas(self) -> None:
        """Once the stage uses the offered placement, the shards keep only its (and a pending one's) replicas."""
        if self.in_use != self.placement.version or self.dropped == self.in_use:
            return
        self.dropped = self.in_use
        pending = self.pending.replicas if self.pending else [()] * len(self.shards)
        for (_, _, shard), keep, coming in zip(self.shards, self.placement.replicas, pending):
            shard.keep_replicas.remote(sorted({*keep, *coming}))

    def rebalance(self, redundant_experts: int | None = None) -> dict:
        """Place replicas for the load since the last rebalance (the shards start loading them) ->
        the window's max / mean shard load under the current placement and under the new one."""
        slots = self.redundant_experts if redundant_experts is None else redundant_experts
        window = self.load - self.window_start
        self.window_start = self.load.clone()
        target = balance(self.placement, window, slots)
        if target.replicas != self.placement.replicas:  # else the stage keeps what it has
            for (_, _, shard), experts in zip(self.shards, target.replicas):
                shard.add_replicas.remote(list(experts))
            self.pending = target
        return {"max_over_mean_before": max_over_mean(self.placement.shard_loads(window)),
                "max_over_mean_after": max_over_mean(target.shard_loads(window)),
                "version": target.version, "replicas": [list(r) for r in target.replicas]}

    def restore_replicas(self) -> None:
        """A dispatch over replicas failed (a restarted shard comes back without them): offer the
        static ranges now, and the replicas again once the shards hold them."""
        lost = self.pending or self.placement
        version = max(self.placement.version, lost.version)
        self.placement = Placement(lost.ranges, tuple(() for _ in lost.ranges), version + 1)
        self.pending = Placement(lost.ranges, lost.replicas, version + 2)
        for (_, _, shard), experts in zip(self.shards, lost.replicas):
            shard.add_replicas.remote(list(experts))

    def reset_placement(self) -> Placement:
        """After a fault in the replica: offer the static ranges (a version above every one offered
        so far, so no answer to an older report replaces it) with nothing pending -> that placement,
        which the runner hands the stage (the next rebalance places replicas again)."""
        version = max(self.placement.version, self.pending.version if self.pending else 0) + 1
        self.placement = Placement(self.placement.ranges, tuple(() for _ in self.shards), version)
        self.pending, self.in_use, self.dropped = None, version, version
        return self.placement

    def current_placement(self) -> dict:
        """The placement offered, the version the stage uses, and whether one is still loading."""
        return {"version": self.placement.version, "in_use": self.in_use, "pending": self.pending is not None,
                "replicas": [list(r) for r in self.placement.replicas],
                "replicated_placements": self.replicated_placements}

    def expert_load(self) -> list[int]:
        return self.load.tolist()

    def ready(self) -> dict:
        return {"shards": [(e0, e1) for e0, e1, _ in self.shards],
                "node_id": ray.get_runtime_context().get_node_id(), "restarted": self.restarted}
