"""How a pipeline stage's MoE layers reach the expert shards (ParallelConfig.moe_dispatch): one
batched call per shard per layer, carrying the rows routed to that shard (a small step's rows go
whole to every shard they touch), partial outputs summed.

- "direct" (the default): the stage calls its router's shards itself and reports its load counts
  to the router once per step;
- "router": every MoE layer's rows go stage -> router -> shards -> router -> stage (one more actor
  call in series per layer: ~2 ms more here), the router counting the load;
- "compiled": "direct" through a Ray Compiled Graph the stage compiles over its shards.

The stage builds its MoE layers with RemoteExperts over one of these (the model's ExpertBackend);
the MoERouter actor (pipeline/moe_router.py) owns the shard map, the load counts and the expert placement: with
replicas of hot experts placed (pipeline/expert_placement.py), each (row, expert) pair goes to one copy of
its expert, the new placement taken up between steps."""

from __future__ import annotations

import time

import ray
import torch
from ray.dag import InputNode, MultiOutputNode

from k3ray.actors.pipeline.expert_placement import Placement
from k3ray.actors.pipeline.protocol import StageFailure
from k3ray.actors.pipeline.wire import Bundle, pack, sum_raw, unpack_raw
from k3ray.models.moe import ExpertBackend

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
          every_shard: bool = False, placement: Placement | None = None
          ) -> tuple[list, list[Bundle], list[torch.Tensor] | None]:
    """The calls of one layer's dispatch: (target shards, one bundle each tagged with the layer,
    rows [T_s] per target or None when each target gets the whole step). A shard none of the rows
    is routed to is left out unless every_shard (a compiled graph runs all its nodes). With a
    placement holding replicas, each (row, expert) pair goes to one copy of its expert."""
    if placement is not None and placement.replicated:
        return _split_over_copies(shards, layer_idx, h, ids, weights, every_shard, placement)
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


def _split_over_copies(shards: ShardMap, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       every_shard: bool, placement: Placement) -> tuple[list, list[Bundle], list[torch.Tensor]]:
    """split for a placement with replicas: each shard gets the rows with a pair it owns
    (Placement.pair_owners), the other pairs' ids set to -1 (no expert: they add 0), and the
    replicas it computes them with (a shard may hold others, loading or dropping)."""
    if h.numel() * h.element_size() <= BROADCAST_BYTES:  # each target gets the whole step, its pairs' ids only
        flat = ids.flatten().tolist()
        owners = placement.pair_owners_list(flat)
        targets, bundles = [], []
        for s, (_, _, shard) in enumerate(shards):
            if s in owners or every_shard:
                mine = torch.tensor([e if o == s else -1 for e, o in zip(flat, owners)], dtype=ids.dtype)
                bundles.append(pack(h, mine.view(ids.shape), weights, placement.replica_tensors[s], tag=layer_idx))
                targets.append(shard)
        return targets, bundles, None
    owners = placement.pair_owners(ids)  # [T, k]
    rows, bundles, targets = [], [], []
    for s, (_, _, shard) in enumerate(shards):
        mine = owners == s  # [T, k]
        r = mine.any(-1).nonzero().squeeze(-1)  # [T_s]
        if r.numel() or every_shard:
            rows.append(r)
            bundles.append(pack(h[r], torch.where(mine[r], ids[r], -1), weights[r], placement.replica_tensors[s],
                                tag=layer_idx))
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
            timeout_s: float, placement: Placement | None = None) -> torch.Tensor:
    """h [T, Dl], ids / weights [T, k] -> y [T, Dl] fp32: every shard with an expert of some row
    computes those rows' experts in its range (other ids add 0), or with replicas placed the pairs
    the placement gives it; the calls run concurrently."""
    # every bundle is packed before the first call goes out: packing between submissions competed
    # with Ray's sending threads and the first shard for the 2 cores
    targets, bundles, rows = split(shards, layer_idx, h, ids, weights, placement=placement)
    refs = [shard.compute.remote(bundle) for shard, bundle in zip(targets, bundles)]
    return combine(h.shape, rows, ray.get(refs, timeout=timeout_s) if refs else [])


class RoutedDispatch:
    """Each layer's rows through the router actor, which fans them out and counts the load."""

    def __init__(self, router: "ray.actor.ActorHandle", timeout_s: float):
        self.router, self.timeout_s = router, timeout_s

    def __call__(self, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ref = self.router.dispatch.remote(pack(h, ids, weights, tag=layer_idx))
        return unpack_raw(ray.get(ref, timeout=self.timeout_s), torch.float32, h.shape)

    def flush(self) -> None:
        """Tell the router a step ended (not awaited): it switches to a new placement only there."""
        self.router.end_step.remote()

    def reset(self, placement: Placement) -> None:
        """After a fault: the router holds the placement (MoERouter.reset_placement)."""


class DirectDispatch:
    """A stage's MoE layers calling the router's shards themselves; the load counts go to the
    router once per step (`flush`, not awaited), and its answer, a newer placement once the shards
    hold its replicas, replaces the placement between two steps."""

    def __init__(self, router: "ray.actor.ActorHandle", num_experts: int, timeout_s: float):
        self.router, self.timeout_s = router, timeout_s
        self.shards = ray.get(router.shard_map.remote(), timeout=timeout_s)
        self.placement = Placement.static([(e0, e1) for e0, e1, _ in self.shards])
        self.update: "ray.ObjectRef | None" = None  # the router's answer to the last flush
        self.load = torch.zeros(num_experts, dtype=torch.long)
        self.dispatches = 0

    def __call__(self, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        try:
            y = self.fan_out(layer_idx, h, ids, weights)
        except Exception:
            if self.placement.replicated:  # a restarted shard lost its replicas: the static ranges always hold
                self.placement = Placement(self.placement.ranges, tuple(() for _ in self.shards), self.placement.version)
                self.router.restore_replicas.remote()
            raise
        self.load += torch.bincount(ids.flatten(), minlength=self.load.numel())
        self.dispatches += 1
        return y

    def fan_out(self, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fan_out(self.shards, layer_idx, h, ids, weights, self.timeout_s, self.placement)

    def flush(self) -> "ray.ObjectRef | None":
        """At the end of a step: take up a placement the router answered with, then report this
        step's load."""
        if self.update is not None and ray.wait([self.update], timeout=0)[0]:
            update, self.update = self.update, None
            newer = ray.get(update)  # a failed report fails this step once, never every later one
            if newer is not None:
                self.placement = newer
        if not self.dispatches:
            return None
        ref = self.router.record_load.remote(pack(self.load), self.dispatches, self.placement.version)
        self.update = ref
        self.load = torch.zeros_like(self.load)
        self.dispatches = 0
        return ref

    def reset(self, placement: Placement) -> None:
        """After a fault: take up the router's reset placement; the answer to an older report and
        the counts of a failed step are dropped."""
        self.placement, self.update = placement, None
        self.load = torch.zeros_like(self.load)
        self.dispatches = 0


class CompiledDispatch(DirectDispatch):
    """Direct dispatch through a Ray Compiled Graph that the stage compiles over its shards: the
    rows go out and the partial outputs come back over Ray's compiled-graph channels instead of one
    actor call per shard. Every shard gets a (possibly empty) slice each layer, since a compiled
    graph runs all its nodes. A failed execution tears the graph down; the next call compiles it
    again (a restarted shard is a new process). A restarted stage restarts its shards first."""

    def __init__(self, router: "ray.actor.ActorHandle", num_experts: int, timeout_s: float):
        super().__init__(router, num_experts, timeout_s)
        self.graph = None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._restart_shards()

    def _restart_shards(self) -> None:
        """A restarted stage: its shards may still be held by the dead stage's compiled graph (an
        actor runs one at a time, and a graph whose driver died is not released), so they restart
        too, reloading their weights."""
        for _, _, shard in self.shards:
            ray.kill(shard, no_restart=False)
        deadline = time.monotonic() + self.timeout_s
        for _, _, shard in self.shards:
            while True:
                try:
                    ray.get(shard.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ray.exceptions.RayActorError:  # still going down or coming back
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def fan_out(self, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.graph = self._compile()
        _, bundles, rows = split(self.shards, layer_idx, h, ids, weights, every_shard=True, placement=self.placement)
        try:
            parts = ray.get(self.graph.execute(*bundles), timeout=self.timeout_s)
        except Exception as e:
            self.close()
            raise StageFailure(f"compiled MoE dispatch of layer {layer_idx} failed: {type(e).__name__}: {e}") from e
        return combine(h.shape, rows, parts)

    def reset(self, placement: Placement) -> None:
        """As DirectDispatch.reset; the graph is compiled again at the next call (over restarted shards too)."""
        super().reset(placement)
        self.close()

    def _compile(self):
        with InputNode() as inp:  # inp[s]: shard s's rows, tagged with the layer
            graph = MultiOutputNode([shard.compute.bind(inp[s]) for s, (_, _, shard) in enumerate(self.shards)])
        return graph.experimental_compile()

    def close(self) -> None:
        if self.graph is not None:
            graph, self.graph = self.graph, None
            try:
                graph.teardown()
            except Exception:  # noqa: BLE001 - a graph with a dead actor may not tear down cleanly
                pass


MoEDispatch = RoutedDispatch | DirectDispatch


def make_dispatch(mode: str, router: "ray.actor.ActorHandle", num_experts: int, timeout_s: float) -> MoEDispatch:
    """The dispatch of ParallelConfig.moe_dispatch `mode` over `router`'s shards."""
    if mode == "router":
        return RoutedDispatch(router, timeout_s)
    kinds = {"direct": DirectDispatch, "compiled": CompiledDispatch}
    assert mode in kinds, f"unknown moe_dispatch {mode!r}"  # ParallelConfig validated it
    return kinds[mode](router, num_experts, timeout_s)


class RemoteExperts(ExpertBackend):
    """One MoE layer's experts, computed by the shards through a stage's dispatch. The rows go
    through host memory from a GPU stage too: the stage itself makes the calls, and Ray's GPU
    transports carry only what an actor method returns to another actor's task (GPU objects) or
    the edges between actors of a compiled graph, never a graph driver's own inputs or outputs."""

    def __init__(self, dispatch: MoEDispatch, layer_idx: int):
        super().__init__()
        self.dispatch, self.layer_idx = dispatch, layer_idx

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = self.dispatch(self.layer_idx, h.cpu(), ids.cpu(), weights.cpu())  # no-ops on a CPU stage
        return y.to(h.device)
