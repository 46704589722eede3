"""RayExecutor: the engine's Executor over Ray actors — one model replica in its own placement
group: pipeline stages, one MoE router per stage and its expert shards, and a VisionEncoder when
the checkpoint has a vision tower — driven one step at a time. The scheduler stays in the driver;
only plan tensors (media rows included) and logits cross the boundary.

    executor = RayExecutor(checkpoint, ParallelConfig(pipeline=2))      # actors start in allocate_cache
    engine = LLMEngine(executor, config, tokenizer,
                       vision_encoder=executor.encode_media if executor.has_vision else None)
    runner = RayExecutor(checkpoint, parallel, CacheSpec(4, 32, 8))     # started now: step(BatchPlan)

Activations go stage to stage as object refs (never through the driver); the driver only gets
the last stage's logits. Every wait has a timeout; a dead or stuck actor fails the step with
StageFailure, and Ray restarts the actor (which reloads its weights, with empty caches). Faults are
contained by PipelineFaults (pipeline/faults.py): steps are refused while the runner waits for the
restarted actors and rebuilds around them, and `health()` probes the real step path (one token in
a state slot and MLA block of its own, beyond the engine's).

Actors given GPUs compute on them (actor_device). The tensor path between stages is chosen once
the actors are up (hop_transport): "nccl" (Ray's GPU-object transport, GPU to GPU) when every
stage holds its own GPU and can run NCCL, "gloo" (the same collective path over GLOO, CPU stages)
when asked, else "host" (wire bundles through host memory: CPU stages, and stages sharing a GPU,
which NCCL cannot connect). A collective hop path is one Ray collective group over the stages;
after a step on it fails, the next step first starts fresh stage actors and a new group over them
(Ray kills both ends of a failed collective transfer for good, and a restarted stage is in no group).
A prefill/decode handoff's parts stay at the stages that read them (read_handoff), in the object store
or, with handoff_transport "nixl", in the stage's own memory for Ray's NIXL transport
(pipeline/stage_records.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import ray
import torch
from ray.experimental.collective import create_collective_group, destroy_collective_group
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.placement_group import placement_group as ray_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3ray.actors.pipeline.actor_bundles import actor_bundles
from k3ray.actors.pipeline.expert_shard import ExpertShard
from k3ray.actors.pipeline.faults import ALIVE, REPLACED, RESTARTED, PipelineFaults
from k3ray.actors.pipeline.moe_dispatch import ShardMap
from k3ray.actors.pipeline.moe_router import MoERouter
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.actors.pipeline.protocol import CacheSpec, PipelineLost, StageFailure, WirePlan
from k3ray.actors.pipeline.stage import PipelineStage
from k3ray.actors.pipeline.stage_records import NIXL, PartOwnerLostError, StageRecords, handoff_transport
from k3ray.actors.pipeline.vision_encoder import VisionEncoder
from k3ray.actors.pipeline.wire import unpack
from k3ray.capacity import split_range
from k3ray.config import ModelConfig
from k3ray.engine.core.cache_manager import CacheGeometry, CacheLayout
from k3ray.engine.disagg.handoff import CacheRecord, HandoffMismatchError, RemoteCacheRecord, local_record
from k3ray.engine.execution.executor import Executor
from k3ray.engine.execution.plan import BatchPlan, DraftPlan, StepPlan
from k3ray.vision import has_vision_weights

logger = logging.getLogger(__name__)


# a handoff part's owner gone (ObjectLostError, PartOwnerLostError), or a NIXL pull from it that failed
LOST_IN_TRANSIT = (ray.exceptions.ObjectLostError, ray.exceptions.RayDirectTransportError, PartOwnerLostError)

# hop transports that carry the tensors themselves over a collective group of the stages -> its backend
COLLECTIVE_BACKENDS = {"nccl": "nccl", "gloo": "torch_gloo"}


@dataclass
class _StageGroup:
    layers: tuple[int, int]
    stage: "ray.actor.ActorHandle"
    router: "ray.actor.ActorHandle | None"
    shards: ShardMap


def hop_transport(parallel: ParallelConfig, stage_infos: list[dict]) -> str:
    """How hidden states go between the stages, from each stage's placement_info: "nccl" when
    the config allows it and every stage has GPUs of its own (no two on one GPU of one node) and
    NCCL (cupy) at hand; "gloo" when asked and every stage computes on the CPU; else "host"."""
    if parallel.stage_transport == "host" or len(stage_infos) < 2:
        return "host"
    if parallel.stage_transport == "gloo":  # Ray's GLOO transport carries CPU tensors only
        return "gloo" if all(info["device"] == "cpu" for info in stage_infos) else "host"
    gpus = [(info["node_id"], g) for info in stage_infos for g in info["gpu_ids"]]
    own_gpus = all(info["gpu_ids"] for info in stage_infos) and len(set(gpus)) == len(gpus)
    return "nccl" if own_gpus and all(info["nccl"] for info in stage_infos) else "host"


def _whole_gpus(resources: dict[str, float]) -> bool:
    """Whether an actor with these resources holds at least one GPU of its own."""
    return resources.get("GPU", 0) >= 1


class RayExecutor(Executor):
    def __init__(self, checkpoint: str, parallel: ParallelConfig, cache: CacheSpec | None = None, *,
                 dtype: torch.dtype = torch.float32, ready_timeout_s: float = 300.0, name: str = "k3ray",
                 placement_group: "PlacementGroup | None" = None, bundle_offset: int = 0):
        """The actors start when the engine sizes the cache (allocate_cache), or now with `cache`
        (steps driven without an engine). With `placement_group`, the actors use its bundles from
        `bundle_offset` on (a Serve replica's own group, released with the replica); otherwise the
        executor creates one."""
        self.config = ModelConfig.from_json_file(f"{checkpoint}/config.json")
        if parallel.pipeline > self.config.num_layers:
            raise ValueError(f"pipeline={parallel.pipeline} exceeds the model's {self.config.num_layers} layers")
        if parallel.expert_parallel > self.config.num_experts:
            raise ValueError(f"expert_parallel={parallel.expert_parallel} exceeds num_experts={self.config.num_experts}")
        self.checkpoint, self.parallel, self.dtype = checkpoint, parallel, dtype
        self._start_args = (ready_timeout_s, name, placement_group, bundle_offset)
        self.started = False
        if cache is not None:
            self._start(cache)

    # the Executor interface ----------------------------------------------------------------------
    def cache_layout(self) -> CacheLayout:
        return [(self.config, self.dtype)]

    def allocate_cache(self, geometry: CacheGeometry) -> None:
        """Start the actors with caches of this geometry (restarting them if they run)."""
        self.shutdown()
        self._start(CacheSpec(geometry.num_state_slots, geometry.num_blocks, geometry.block_size,
                              str(self.dtype).removeprefix("torch.")))

    def propose(self, plan: DraftPlan) -> torch.Tensor:
        raise ValueError("draft-model speculation is not available on the Ray executor; use method='ngram'")

    @property
    def has_vision(self) -> bool:
        """Whether the replica runs a VisionEncoder actor (see `encode_media`)."""
        return (self.config.vision is not None and self.parallel.vision_resources is not None
                and has_vision_weights(self.checkpoint))

    # the actors ----------------------------------------------------------------------------------
    def _start(self, cache: CacheSpec) -> None:
        ready_timeout_s, name, placement_group, bundle_offset = self._start_args
        checkpoint, parallel = self.checkpoint, self.parallel
        self.dtype = getattr(torch, cache.dtype)
        self.cache_spec = cache
        # the health probe's state slot and MLA block: one of each beyond the engine's
        self._probe_plan = BatchPlan(torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([1]),
                                     torch.tensor([cache.num_state_slots]), torch.tensor([[cache.num_blocks]]),
                                     logits_indices=torch.tensor([0]))
        stage_cache = replace(cache, num_state_slots=cache.num_state_slots + 1, num_blocks=cache.num_blocks + 1)
        layer_ranges = split_range(self.config.num_layers, parallel.pipeline)
        expert_ranges = split_range(self.config.num_experts, parallel.expert_parallel)
        bundles, roles = actor_bundles(self.config, parallel)
        self.owns_pg = placement_group is None
        if placement_group is None:
            placement_group = ray_placement_group(bundles, strategy=parallel.placement_strategy, name=f"{name}-replica")
            bundle_offset = 0
        self.pg = placement_group
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except Exception as e:
            if self.owns_pg:
                remove_placement_group(self.pg)
            raise StageFailure(
                f"placement group of {len(bundles)} bundles ({bundles[0]} ...) was not ready in {ready_timeout_s}s; "
                "check resources with `ray status` and `ray list nodes`"
            ) from e

        def opts(bundle: int, resources: dict[str, float]):
            res = dict(resources)
            return {
                "num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0), "resources": res or None,
                "max_restarts": parallel.max_restarts, "max_task_retries": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            }

        # stages that may hand their hidden states on over a collective group must be created able to
        may_use_collective = parallel.pipeline > 1 and (
            parallel.stage_transport == "gloo"
            or parallel.stage_transport == "auto" and _whole_gpus(parallel.stage_resources))
        # a class option: Ray reads it when the class is made remote and ignores it in .options()
        remote_stage = ray.remote(enable_tensor_transport=True)(PipelineStage) if may_use_collective \
            else ray.remote(PipelineStage)

        index = {role: bundle_offset + b for b, role in enumerate(roles)}
        self.groups: list[_StageGroup] = []
        self.stage_group = None  # Ray's collective group over the stages, when hops use one
        self.stage_group_restarts = 0  # each one counts against parallel.max_restarts
        self.vision: "ray.actor.ActorHandle | None" = None
        self.faults: PipelineFaults | None = None
        self.started = True  # holds actors from here on: shutdown() releases them

        def start_stage(s: int, router: "ray.actor.ActorHandle | None") -> "ray.actor.ActorHandle":
            return remote_stage.options(**opts(index[("stage", s, None)], parallel.stage_resources)).remote(
                checkpoint, layer_ranges[s], stage_cache, router, parallel)

        self._start_stage = start_stage
        for s, layers in enumerate(layer_ranges):
            shards, router = [], None
            if ("router", s, None) in index:
                for e, er in enumerate(expert_ranges):
                    actor = ray.remote(ExpertShard).options(
                        **opts(index[("shard", s, e)], parallel.shard_resources)
                    ).remote(checkpoint, layers, er, cache.dtype, parallel.torch_threads)
                    shards.append((er[0], er[1], actor))
                router = ray.remote(MoERouter).options(
                    **opts(index[("router", s, None)], parallel.router_resources)
                ).remote(shards, self.config.num_experts, parallel.call_timeout_s, parallel.torch_threads,
                         *self._balancing(parallel))
            self.groups.append(_StageGroup(layers, start_stage(s, router), router, shards))
        if ("vision", 0, None) in index and has_vision_weights(checkpoint):
            self.vision = ray.remote(VisionEncoder).options(
                **opts(index[("vision", 0, None)], parallel.vision_resources)
            ).remote(checkpoint, cache.dtype, parallel.torch_threads)
        self.placement, infos = self._wait_ready(ready_timeout_s)
        self.hop_transport = hop_transport(parallel, infos) if may_use_collective else "host"
        try:
            self.handoff_transport = handoff_transport(parallel, infos)
        except ValueError:
            self.shutdown()
            raise
        if parallel.stage_transport == "gloo" and self.hop_transport == "host" and parallel.pipeline > 1:
            logger.warning("pipeline hops go through host memory: GLOO carries CPU tensors only, and a stage has a GPU")
        if self.hop_transport in COLLECTIVE_BACKENDS:
            self._connect_stages()
        self.faults = PipelineFaults(self.ping, self._rebuild, self._probe, ready_timeout_s, parallel.call_timeout_s)
        self._last_load: list[list[int]] = [[0] * self.config.num_experts if g.router else [] for g in self.groups]

    @staticmethod
    def _balancing(parallel: ParallelConfig) -> tuple[int, int]:
        """(redundant_experts, rebalance_steps) for the routers: on with expert parallelism only."""
        if parallel.expert_parallel < 2:
            return 0, 0
        return parallel.redundant_experts, parallel.rebalance_steps

    def rebalance_experts(self) -> list[dict | None]:
        """Per stage: have its router place replicas for the load since its last rebalance now
        (None for a stage without MoE layers); the stages take the placement up between steps."""
        return [self._get(g.router.rebalance.remote(), "expert rebalance") if g.router else None for g in self.groups]

    def expert_placements(self) -> list[dict | None]:
        """Per stage: the router's placement (MoERouter.current_placement), None without MoE layers."""
        return [self._get(g.router.current_placement.remote(), "expert placement") if g.router else None
                for g in self.groups]

    def _connect_stages(self) -> None:
        """One collective group over the stages, with hop_transport's backend (an old one dropped
        first); a failure leaves the hops on host memory, logged."""
        if self.stage_group is not None:
            old, self.stage_group = self.stage_group, None
            try:
                destroy_collective_group(old)
            except ValueError:  # Ray drops the group itself after a failed transfer
                pass
        try:
            self.stage_group = create_collective_group([g.stage for g in self.groups],
                                                       backend=COLLECTIVE_BACKENDS[self.hop_transport])
        except Exception as e:  # noqa: BLE001 - any failure falls back to the path that always works
            logger.warning("pipeline hops go through host memory: %s between the stages failed: %s",
                           self.hop_transport, e)
            self.hop_transport = "host"

    def _rejoin_stages(self) -> None:
        """After a fault on a collective hop path: fresh stage actors on the same bundles
        (with empty caches, as a restart), and a new group over them once they have loaded.
        Restarting in place cannot work: a restarted stage is in no group, and Ray kills both
        ends of a failed collective transfer for good, possibly after the step has failed."""
        if self.stage_group_restarts >= self.parallel.max_restarts:
            raise PipelineLost(f"the stages were restarted {self.stage_group_restarts} times (max_restarts)")
        self.stage_group_restarts += 1
        for s, g in enumerate(self.groups):
            ray.kill(g.stage, no_restart=True)
            g.stage = self._start_stage(s, g.router)
        self._get([g.stage.ready.remote() for g in self.groups], "stage restart")
        self._connect_stages()

    def _rebuild(self) -> bool:
        """After a fault, every actor answering again (PipelineFaults): the routers offer their
        static ranges and the stages take them up (a restarted shard holds no replicas, a restarted
        router no placement), a collective hop path gets fresh stages and group, and the restarted
        actors are taken back -> whether stage caches were lost."""
        placements = [self._get(g.router.reset_placement.remote(), "placement reset") if g.router else None
                      for g in self.groups]
        rejoined = self.hop_transport in COLLECTIVE_BACKENDS
        if rejoined:
            self._rejoin_stages()
        self._get([g.stage.reset_dispatch.remote(p) for g, p in zip(self.groups, placements)], "dispatch reset")
        stages = self._get([g.stage.ready.remote() for g in self.groups], "stage check")
        self._get([handle.adopt.remote() for _, handle in self.actors()], "restart adoption")
        return rejoined or any(info["restarted"] for info in stages)

    def _probe(self) -> None:
        """One token through every stage (and the shards it routes to), in the probe's own slot and block."""
        logits = self._step(self._probe_plan)
        if not torch.isfinite(logits).all():
            raise StageFailure("the health probe step's logits are not finite")

    def ping(self, timeout_s: float = 5.0) -> dict[str, str]:
        """Every actor's state, asked at once: ALIVE, RESTARTED (alive after a restart Ray made, not
        taken back yet), "restarting", "dead (...)" (gone for good; REPLACED for a stage of a
        collective hop path, which the recovery starts afresh), or what else went wrong."""
        named = self.actors()
        replaceable = {name for name, _ in named if name.startswith("stage ")} \
            if self.hop_transport in COLLECTIVE_BACKENDS else set()
        refs = [handle.ready.remote() for _, handle in named]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        status = {}
        for (name, _), ref in zip(named, refs):
            if ref not in done:
                status[name] = f"not answering within {timeout_s:.0f} s"
                continue
            try:
                info = ray.get(ref)
                self.placement[name] = info["node_id"]  # follows a restart on another node
                status[name] = RESTARTED if info.get("restarted") else ALIVE
            except ray.exceptions.ActorUnavailableError:
                status[name] = "restarting"
            except ray.exceptions.ActorDiedError as e:
                status[name] = REPLACED if name in replaceable else f"dead ({type(e).__name__})"
            except Exception as e:  # noqa: BLE001 - any failure is reported, not raised
                status[name] = f"unavailable: {type(e).__name__}"
        return status

    def actors(self) -> list[tuple[str, "ray.actor.ActorHandle"]]:
        out = []
        for s, g in enumerate(self.groups):
            out.append((f"stage {s} (layers {g.layers[0]}-{g.layers[1] - 1})", g.stage))
            if g.router is not None:
                out.append((f"router {s}", g.router))
            out += [(f"expert shard {e0}-{e1 - 1} of stage {s}", h) for e0, e1, h in g.shards]
        if self.vision is not None:
            out.append(("vision encoder", self.vision))
        return out

    def _wait_ready(self, timeout_s: float) -> tuple[dict[str, str], list[dict]]:
        """(node of each actor by name, the stages' ready() infos in stage order)."""
        named = self.actors()
        try:
            infos = ray.get([h.ready.remote() for _, h in named], timeout=timeout_s)
        except Exception as e:
            self.shutdown()
            raise StageFailure(f"model actors did not start: {e}") from e
        stage_infos = [info for (name, _), info in zip(named, infos) if name.startswith("stage ")]
        return {name: info["node_id"] for (name, _), info in zip(named, infos)}, stage_infos

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """One engine step: its state copies and batches -> logits of every batch, concatenated."""
        assert self.started, "allocate_cache() first"
        with self.faults.stepping():
            self._copy_states(plan.pre_copies)
            out = [self._step(b) for b in plan.batches]
            self._copy_states(plan.post_copies)
        return torch.cat(out) if out else torch.zeros(0, self.config.vocab_size)

    def step(self, plan: BatchPlan) -> torch.Tensor:
        """Run one batch through every stage -> logits [len(plan.logits_indices), V] fp32."""
        with self.faults.stepping():
            return self._step(plan)

    def _step(self, plan: BatchPlan) -> torch.Tensor:
        collective = self.hop_transport in COLLECTIVE_BACKENDS
        ref = None
        last = len(self.groups) - 1
        first, rest = WirePlan.encode(plan), None  # media rows go to the first stage only
        for s, g in enumerate(self.groups):
            if s > 0 and rest is None:
                rest = WirePlan.encode(plan.without_media())
            stage_plan = first if s == 0 else rest
            if collective and s < last:
                ref = g.stage.forward.options(tensor_transport=self.hop_transport).remote(stage_plan, ref, True)
            else:
                ref = g.stage.forward.remote(stage_plan, ref)
        try:
            return unpack(self._get(ref, "model step"))[0]
        except ray.exceptions.RayTaskError as e:
            if not collective:
                raise
            # a hop whose peer died or is in no group fails inside the receiving stage
            raise StageFailure(f"model step failed on the {self.hop_transport} hop path: {type(e.cause).__name__}: "
                               f"{e.cause}") from e

    def encode_media(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """Packed media -> [n_tokens, text_hidden] from the replica's VisionEncoder."""
        assert self.started, "allocate_cache() first"
        if self.vision is None:
            raise ValueError("this replica has no vision encoder (the checkpoint has no vision tower)")
        with self.faults.stepping():
            return self._get(self.vision.encode.remote(pixel_values, grid_thws), "vision encode")

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = [int(a) for a, _ in pairs], [int(b) for _, b in pairs]
            self._get([g.stage.copy_states.remote(src, dst) for g in self.groups], "state copy")

    def read_handoff(self, slot: int, rows: torch.Tensor) -> list[StageRecords]:
        """Each stage reads its own layers' part and leaves it where it stays (StageRecords: in the object
        store, or at the stage with NIXL); this waits for every read (the slot and blocks may be reused
        after) and fetches only the sizes."""
        assert self.started, "allocate_cache() first"
        with self.faults.stepping():
            if self.handoff_transport == NIXL:
                read = self._get([g.stage.read_handoff.remote(slot, rows, NIXL) for g in self.groups], "handoff read")
                sizes, parts = [size for size, _ in read], [refs[0] for _, refs in read]
            else:
                calls = [g.stage.read_handoff.options(num_returns=2).remote(slot, rows) for g in self.groups]
                sizes, parts = self._get([size for size, _ in calls], "handoff read"), [part for _, part in calls]
        total = {kind: sum(s[kind] for s in sizes) for kind in ("state", "mla_latent")}
        return [StageRecords([(g.layers, part) for g, part in zip(self.groups, parts)], total,
                             self.parallel.call_timeout_s, self.handoff_transport, [g.stage for g in self.groups])]

    def write_handoff(self, records: list[CacheRecord | RemoteCacheRecord], slot: int, rows: torch.Tensor) -> None:
        """Each stage writes its own layers' part: straight from the prefill stage that holds the same
        layers when the layouts match, else from the record fetched here. A part lost in transit (its
        prefill replica gone) is a HandoffMismatchError: the sender asks again; this pipeline is fine."""
        assert self.started, "allocate_cache() first"
        if len(records) != 1:
            raise HandoffMismatchError(f"the handoff holds {len(records)} models' caches, this pipeline one")
        record = records[0]
        ranges = [g.layers for g in self.groups]
        try:
            if isinstance(record, StageRecords) and record.layer_ranges == ranges:
                # a NIXL part goes by reference (in a list), for the stage to pull onto its own device
                parts = [[ref] if record.left_with == NIXL else ref for _, ref in record.parts]
            else:
                whole = local_record(record)
                parts = [whole.select(range(*layers)) for layers in ranges]
            with self.faults.stepping():
                writes = [g.stage.write_handoff.remote(part, slot, rows) for g, part in zip(self.groups, parts)]
                try:
                    ray.get(writes, timeout=self.parallel.call_timeout_s)
                except LOST_IN_TRANSIT:
                    raise
                except Exception:  # noqa: BLE001 - this pipeline's own failure: as every other call
                    self._get(writes, "handoff write")
                    raise
        except LOST_IN_TRANSIT as e:
            raise HandoffMismatchError(f"the handoff's caches were lost in transit ({type(e).__name__}: the prefill "
                                       "replica or stage that held them is gone)") from e

    def expert_load(self) -> list[list[int]]:
        """Per stage: routed (token, expert) pairs per expert since start (Router counters); the
        last counts while the pipeline recovers or an actor does not answer (a scrape never fails)."""
        if not self.started:
            return []
        if self.faults.fault is not None:
            return self._last_load
        try:
            if self.parallel.moe_dispatch != "router":
                self._get([g.stage.flush_load.remote() for g in self.groups if g.router], "expert load")
            self._last_load = [self._get(g.router.expert_load.remote(), "expert load") if g.router else []
                               for g in self.groups]
        except StageFailure:
            pass
        return self._last_load

    def health(self) -> dict:
        """Whether the pipeline can step (PipelineFaults.health: a probe step while idle, the last
        step while busy, a fault's state), each actor's state, and Ray nodes that left the cluster
        ("lost_nodes": node id -> the actors last seen there; an actor Ray restarted elsewhere
        moves with the next ping)."""
        if not self.started:
            return {"healthy": False, "state": "not started", "cause": "allocate_cache() was not called",
                    "actors": {}, "lost_nodes": {}}
        report = self.faults.health()
        nodes = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        lost: dict[str, list[str]] = {}
        for name, node in list(self.placement.items()):
            if not nodes.get(node, False):
                lost.setdefault(node, []).append(name)
        return {**report, "healthy": report["healthy"] and not lost, "lost_nodes": lost,
                "hop_transport": self.hop_transport}

    def _get(self, refs, what: str):
        t0 = time.monotonic()
        try:
            return ray.get(refs, timeout=self.parallel.call_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise StageFailure(f"{what} timed out after {time.monotonic() - t0:.1f}s") from e
        except ray.exceptions.RayActorError as e:
            raise StageFailure(f"{what} failed: an actor of the pipeline died ({type(e).__name__}); "
                               "it restarts with empty caches, so in-flight requests are lost") from e
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, StageFailure):
                raise StageFailure(f"{what} failed inside the pipeline: {cause}") from e
            if isinstance(cause, ray.exceptions.RayError):
                raise StageFailure(f"{what} failed inside the pipeline: {type(cause).__name__}: {cause}") from e
            raise
        except ray.exceptions.RayError as e:  # an object lost with its node, its owner gone, ...
            raise StageFailure(f"{what} failed: {type(e).__name__}: {e}") from e

    def shutdown(self) -> None:
        if not self.started:
            return
        self.started = False
        if self.faults is not None:
            self.faults.close()
        self.stage_group = None  # its communicators end with the stages' processes
        for _, handle in self.actors():
            ray.kill(handle, no_restart=True)
        if self.owns_pg:
            remove_placement_group(self.pg)
