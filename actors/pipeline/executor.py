"""RayExecutor: the engine's Executor over Ray actors (pipeline stages, MoE routers, expert
shards, a vision encoder). The scheduler stays in the driver; only plan tensors (media rows
included) and logits cross the boundary.

    executor = RayExecutor(checkpoint, ParallelConfig(pipeline=2))
    engine = LLMEngine(executor, config, tokenizer,
                       vision_encoder=executor.encode_media if executor.has_vision else None)
"""

from __future__ import annotations

import torch

from k3ray.actors.pipeline.runner import RayModelRunner
from k3ray.actors.pipeline.protocol import CacheSpec, ParallelConfig
from k3ray.config import ModelConfig
from k3ray.engine.cache_manager import CacheGeometry, CacheLayout
from k3ray.engine.executor import Executor
from k3ray.engine.plan import DraftPlan, StepPlan
from k3ray.vision import has_vision_weights


class RayExecutor(Executor):
    def __init__(self, checkpoint: str, parallel: ParallelConfig, dtype: torch.dtype = torch.float32,
                 placement_group=None, bundle_offset: int = 0, ready_timeout_s: float = 300.0):
        self.checkpoint, self.parallel, self.dtype = checkpoint, parallel, dtype
        self.config = ModelConfig.from_json_file(f"{checkpoint}/config.json")
        self._pg, self._offset, self._ready_timeout = placement_group, bundle_offset, ready_timeout_s
        self.runner: RayModelRunner | None = None

    def cache_layout(self) -> CacheLayout:
        return [(self.config, self.dtype)]

    def allocate_cache(self, geometry: CacheGeometry) -> None:
        if self.runner is not None:
            self.runner.shutdown()
        spec = CacheSpec(geometry.num_state_slots, geometry.num_blocks, geometry.block_size,
                         str(self.dtype).removeprefix("torch."))
        self.runner = RayModelRunner(self.checkpoint, self.parallel, spec, self._ready_timeout,
                                     placement_group=self._pg, bundle_offset=self._offset)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        assert self.runner is not None, "allocate_cache() first"
        return self.runner.execute(plan)

    @property
    def has_vision(self) -> bool:
        """Whether the replica runs a VisionEncoder actor (see `encode_media`)."""
        return (self.config.vision is not None and self.parallel.vision_resources is not None
                and has_vision_weights(self.checkpoint))

    def encode_media(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """The engine's vision_encoder on Ray: packed media -> [n_tokens, text_hidden] from the
        replica's VisionEncoder actor."""
        assert self.runner is not None, "allocate_cache() first"
        return self.runner.encode_media(pixel_values, grid_thws)

    def propose(self, plan: DraftPlan) -> torch.Tensor:
        raise ValueError("draft-model speculation is not available on the Ray executor; use method='ngram'")

    def health(self) -> dict:
        return self.runner.health() if self.runner else {"healthy": False, "actors": {}, "lost_nodes": {}}

    def expert_load(self) -> list[list[int]]:
        return self.runner.expert_load() if self.runner else []

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
