"""A handoff's caches left at the prefill pipeline's stages (k3ray/engine/disagg/handoff.py): each stage's
part of one sequence's caches stays where that stage put it, and a decode pipeline whose stages hold
the same layer ranges has each stage fetch its part straight from there (no replica process in
between); any other receiver materializes the record first. If the owner dies before the parts are
fetched, the write fails and the decode side asks again.

Two ways a part stays (handoff_transport, chosen once the stages are up, as the hop transport is):
- "object-store": the part is an object in Ray's object store, owned by the prefill replica that read
  it, copied to host memory first;
- "nixl": the part's tensors stay in the prefill stage's own memory (GPU memory on GPU stages), put
  with Ray's NIXL tensor transport, owned by that stage; the receiving stage pulls them one-sided onto
  its own device. NIXL rather than NCCL: NCCL needs a collective group over both ends, and an actor
  is in one group per backend (the stages' hop group); prefill and decode replicas come and go.
  A receiver that is no stage asks each owning stage for its part on the host instead of pulling it:
  the first NIXL pull in a process starts Ray's NIXL agent there, whose progress thread keeps a core
  busy for the life of the process (a Serve replica, an eval driver).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch
from ray.experimental.rdt import set_target_device_for_ref

from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.engine.disagg.handoff import CacheRecord, RemoteCacheRecord

NIXL = "nixl"
OBJECT_STORE = "object-store"


class PartOwnerLostError(RuntimeError):
    """The prefill stage that holds a NIXL part is gone before the part was fetched."""


def handoff_transport(parallel: ParallelConfig, stage_infos: list[dict]) -> str:
    """How this pipeline's stages leave a handoff's parts, from each stage's placement_info: "nixl"
    when asked, or under "auto" when every stage computes on a GPU and has nixl; else "object-store"."""
    if parallel.handoff_transport == NIXL:
        missing = [i for i, info in enumerate(stage_infos) if not info["nixl"]]
        if missing:
            raise ValueError(f"handoff_transport='nixl' needs the nixl package on every stage's node; stages "
                             f"{missing} have none (pip install 'k3ray[nixl]')")
        return NIXL
    if parallel.handoff_transport == "auto" and all(
            info["device"].startswith("cuda") and info["nixl"] for info in stage_infos):
        return NIXL
    return OBJECT_STORE


def leave_part(record: CacheRecord) -> list[ray.ObjectRef]:
    """A stage's part put with Ray's NIXL transport (its tensors stay here until every reference is
    gone), as a one-item list: returned from a task, the reference is passed on, not resolved."""
    return [ray.put(record, _tensor_transport=NIXL)]


def fetch_part(ref: ray.ObjectRef, device: torch.device | str, timeout_s: float) -> CacheRecord:
    """A part left with NIXL, pulled onto `device` (the receiving stage's, or the CPU)."""
    set_target_device_for_ref(ref, str(device))
    return ray.get(ref, timeout=timeout_s)


def own_part_on_host(ref: ray.ObjectRef, timeout_s: float) -> CacheRecord:
    """A part this process left with NIXL, copied to host memory (no transfer: the tensors are here)."""
    return ray.get(ref, timeout=timeout_s).to("cpu")


@dataclass
class StageRecords(RemoteCacheRecord):
    parts: list[tuple[tuple[int, int], ray.ObjectRef]]  # (layer range [a, b), the stage's CacheRecord)
    sizes: dict[str, int]  # as CacheRecord.nbytes
    timeout_s: float = 300.0
    left_with: str = OBJECT_STORE  # handoff_transport's choice on the prefill side
    stages: list[ray.actor.ActorHandle] | None = None  # NIXL: the stage holding each part

    def materialize(self) -> CacheRecord:
        refs = [ref for _, ref in self.parts]
        if self.left_with != NIXL:
            return CacheRecord.merge(ray.get(refs, timeout=self.timeout_s))
        assert self.stages is not None and len(self.stages) == len(refs)
        calls = [stage.handoff_part_on_host.remote([ref]) for stage, ref in zip(self.stages, refs)]
        try:
            return CacheRecord.merge(ray.get(calls, timeout=self.timeout_s))
        except ray.exceptions.RayActorError as e:
            raise PartOwnerLostError(f"a prefill stage holding a handoff part is gone: {e}") from e

    def nbytes(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def transport(self) -> str:
        return "stage-direct-nixl" if self.left_with == NIXL else "stage-direct"

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [tuple(layers) for layers, _ in self.parts]
