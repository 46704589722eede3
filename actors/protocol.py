"""What crosses the Ray boundary: plain, picklable tensors and frozen configs (no model objects)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

# how a stage's MoE layers reach the expert shards: via the stage's router actor, by the stage's own
# actor calls, or through a Ray Compiled Graph the stage compiles over its shards
MOE_DISPATCH_MODES = ("router", "direct", "compiled")


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
    moe_dispatch: str = "direct"  # the stage calls its shards: one actor call per layer fewer than "router"

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
class StepArgs:
    """One model step: ForwardBatch indices (see k3ray.models.forward_batch) plus token ids, and
    for the first stage the media rows to splice over the token embeddings."""

    input_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [N + 1]
    context_lens: torch.Tensor  # [N]
    state_slots: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, B]
    logits_indices: torch.Tensor | None = None  # rows of T whose logits are returned
    spec_state_slots: torch.Tensor | None = None  # [N, q]
    mm_positions: torch.Tensor | None = None  # [M] rows of T that are media placeholders
    mm_embeds: torch.Tensor | None = None  # [M, D] their embeddings

    def __reduce__(self):
        """Pickled as one wire bundle (see k3ray.actors.wire): far cheaper per call than torch's pickle."""
        from k3ray.actors.wire import pack

        names = tuple(f.name for f in fields(self))
        return (_step_args_from_wire, (names, pack(*(getattr(self, name) for name in names))))

    def without_media(self) -> StepArgs:
        """What stages after the first get: they never read the media rows."""
        return replace(self, mm_positions=None, mm_embeds=None) if self.mm_positions is not None else self

    def batch_kwargs(self) -> dict[str, Any]:
        return {
            "cu_seqlens": self.cu_seqlens,
            "context_lens": self.context_lens,
            "state_slots": self.state_slots,
            "block_tables": self.block_tables,
            "spec_state_slots": self.spec_state_slots,
        }


def _step_args_from_wire(names: tuple[str, ...], bundle) -> StepArgs:
    from k3ray.actors.wire import unpack

    return StepArgs(**dict(zip(names, unpack(bundle))))


class StageFailure(RuntimeError):
    """A pipeline stage, router or expert shard died or timed out during a step."""
