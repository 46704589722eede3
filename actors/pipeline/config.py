"""The pipeline's settings, defined once: ParallelConfig (how one replica is split into actors and
placed) and the choices it checks: how a stage's MoE layers reach its expert shards, how its experts
are balanced, how hidden states and handoffs travel. No heavy imports: `k3ray serve --help` reads it.

MoE dispatch, router: through the stage's MoERouter actor; direct: the stage's own actor calls to the
shards; compiled: a Ray Compiled Graph the stage compiles over its shards (see pipeline/moe_dispatch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

MoEDispatchMode = Literal["router", "direct", "compiled"]
MOE_DISPATCH_MODES: tuple[str, ...] = get_args(MoEDispatchMode)
DEFAULT_MOE_DISPATCH: MoEDispatchMode = "direct"  # one actor call in series per layer fewer than "router"
# expert balancing (pipeline/expert_placement.py), with expert parallelism: replica slots per shard (each MoE
# layer of the stage) for the hottest experts, re-placed every so many steps (0: never)
DEFAULT_REDUNDANT_EXPERTS = 1
DEFAULT_REBALANCE_STEPS = 64
# how hidden states travel between pipeline stages (ParallelConfig.stage_transport)
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
    redundant_experts: int = DEFAULT_REDUNDANT_EXPERTS  # see above
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
