"""What crosses the Ray boundary besides the settings (config.py): the stages' cache sizes, the
engine's BatchPlan as a WirePlan (one wire bundle) and plain tensors (no model objects), and the
failures a step raises."""

from __future__ import annotations

from dataclasses import dataclass, fields

from k3ray.actors.pipeline.wire import Bundle, pack, unpack
from k3ray.engine.execution.plan import BatchPlan
from k3ray.engine.process.errors import ModelUnavailableError


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
