"""A handoff's caches left at the prefill pipeline's stages (k3ray/engine/handoff.py): each stage's
part of one sequence's caches is an object in Ray's object store, owned by the prefill replica that
read it. A decode pipeline whose stages hold the same layer ranges has each stage write its part
straight from there (no replica process in between); any other receiver materializes the record.
If the owner dies before the parts are written, the write fails and the decode side asks again."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from k3ray.engine.handoff import CacheRecord, RemoteCacheRecord


@dataclass
class StageRecords(RemoteCacheRecord):
    parts: list[tuple[tuple[int, int], ray.ObjectRef]]  # (layer range [a, b), the stage's CacheRecord)
    sizes: dict[str, int]  # as CacheRecord.nbytes
    timeout_s: float = 300.0

    def materialize(self) -> CacheRecord:
        return CacheRecord.merge(ray.get([ref for _, ref in self.parts], timeout=self.timeout_s))

    def nbytes(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def layer_ranges(self) -> list[tuple[int, int]]:
        return [tuple(layers) for layers, _ in self.parts]
