"""What crosses the Ray boundary: frozen configs, the engine's BatchPlan as a WirePlan (one wire
bundle) and plain tensors (no model objects)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from k3ray.actors.pipeline.moe_dispatch_modes import (
    DEFAULT_MOE_DISPATCH,
    DEFAULT_REBALANCE_STEPS,
    DEFAULT_REDUNDANT_EXPERTS,
    MOE_DISPATCH_MODES,
)
from k3ray.actors.pipeline.wire import Bundle, pack, unpack
from k3ray.engine.execution.plan import BatchPlan
from k3ray.engine.process.errors import ModelUnavailableError

STAGE_TRANSPORTS = ("auto", "host", "gloo")
# how a prefill pipeline's stages leave their part of a handoff for the decode stages (RayExecutor.read_handoff)
HANDOFF_TRANSPORTS = ("auto", "object-store", "nixl")


@dataclass(frozen=True)
class ParallelConfig:
    """How one model replica is split into actors and placed.

    pipeline: stages of contiguous layers; expert_parallel: expert shards per stage (each holds
    an expert range of that stage's MoE layers); resources are Ray resource dicts per actor (the
    vision encoder's only for a model config with a vision tower); placement_strategy applies to
    the replica's placement group (PACK, SPREAD, STRICT_*)."""

    pipeline: int = 1
    expert_parallel: int = 1
    stage_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    shard_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    router_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 0.5})
    # the VisionEncoder actor of a checkpoint with a vision tower; None: no actor (media refused)
    vision_resources: dict[str, float] | None = field(default_factory=lambda: {"CPU": 0.5})
    placement_strategy: str = "PACK"
    call_timeout_s: float = 120.0  # a step that takes longer fails instead of hanging
    max_restarts: int = 3  # a dead actor restarts and reloads its weights this many times
    torch_threads: int = 1  # per actor process
    moe_dispatch: str = DEFAULT_MOE_DISPATCH
    # hidden states between pipeline stages: "auto" = GPU to GPU over Ray's NCCL tensor transport
    # when every stage holds its own GPU and cupy is installed, else host memory; "host" = always
    # host memory; "gloo" = Ray's GLOO tensor transport between CPU stages (MoE rows always go
    # through host memory: see RayExecutor.hop_transport)
    stage_transport: str = "auto"
    # a prefill/decode handoff's caches, prefill stage to decode stage: "auto" = Ray's NIXL tensor transport
    # (GPU to GPU, one-sided: no collective group) when every stage computes on a GPU and has nixl, else the
    # object store; "object-store" = always; "nixl" = NIXL on any device (CPU stages too: how CI runs it)
    handoff_transport: str = "auto"
    redundant_experts: int = DEFAULT_REDUNDANT_EXPERTS  # see moe_dispatch_modes
    rebalance_steps: int = DEFAULT_REBALANCE_STEPS

    def __post_init__(self) -> None:
        if self.pipeline < 1:
            raise ValueError(f"pipeline must be >= 1, got {self.pipeline}")
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel must be >= 1, got {self.expert_parallel}")
        strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
        if self.placement_strategy not in strategies:
            raise ValueError(f"placement_strategy must be one of {strategies}, got {self.placement_strategy!r}")
        if self.moe_dispatch not in MOE_DISPATCH_MODES:
            raise ValueError(f"moe_dispatch must be one of {MOE_DISPATCH_MODES}, got {self.moe_dispatch!r}")
        if self.stage_transport not in STAGE_TRANSPORTS:
            raise ValueError(f"stage_transport must be one of {STAGE_TRANSPORTS}, got {self.stage_transport!r}")
        if self.handoff_transport not in HANDOFF_TRANSPORTS:
            raise ValueError(f"handoff_transport must be one of {HANDOFF_TRANSPORTS}, got {self.handoff_transport!r}")
        if self.redundant_experts < 0:
            raise ValueError(f"redundant_experts must be >= 0, got {self.redundant_experts}")
        if self.rebalance_steps < 0:
            raise ValueError(f"rebalance_steps must be >= 0, got {self.rebalance_steps}")
        if self.call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {self.call_timeout_s}")


@dataclass(frozen=True)
class CacheSpec:
    """Sizes of the state pools each stage allocates for its own layers."""

    num_state_slots: int
    num_blocks: int
    block_size: int
    dtype: str = "float32"


@dataclass(frozen=True)
class WirePlan:
    """A BatchPlan as it crosses to the stages: its field names and one wire bundle of its tensors,
    far cheaper per call than torch's pickle of each (encoded by the runner, decoded by the stage)."""

    names: tuple[str, ...]
    bundle: Bundle

    @classmethod
    def encode(cls, plan: BatchPlan) -> WirePlan:
        names = tuple(f.name for f in fields(plan))
        return cls(names, pack(*(getattr(plan, name) for name in names)))

    def decode(self) -> BatchPlan:
        return BatchPlan(**dict(zip(self.names, unpack(self.bundle))))


class StageFailure(ModelUnavailableError):
    """A pipeline stage, router or expert shard died or timed out during a step."""


class PipelineLost(StageFailure):
    """An actor of the pipeline is gone for good (out of restarts): the replica must be replaced."""
