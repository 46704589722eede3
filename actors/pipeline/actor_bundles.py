"""The Ray resources of one replica's model actors, in the order the runner places them:
stages, each MoE stage's router and expert shards, then the vision encoder. Ray-free."""

from __future__ import annotations

from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.capacity import split_range
from k3ray.config import ModelConfig


def actor_bundles(config: ModelConfig, parallel: ParallelConfig) -> tuple[list[dict[str, float]], list[tuple]]:
    """Placement-group bundles of one replica's model actors, and the role of each:
    ("stage", s, None) | ("router", s, None) | ("shard", s, e) | ("vision", 0, None) (last, for a
    config with a vision tower). A Serve replica puts its own bundle first and these after it
    (placement_group_bundles)."""
    layer_ranges = split_range(config.num_layers, parallel.pipeline)
    bundles, roles = [], []
    for s, layers in enumerate(layer_ranges):
        bundles.append(dict(parallel.stage_resources))
        roles.append(("stage", s, None))
        if any(config.is_moe_layer(i) for i in range(*layers)):
            bundles.append(dict(parallel.router_resources))
            roles.append(("router", s, None))
            for e in range(parallel.expert_parallel):
                bundles.append(dict(parallel.shard_resources))
                roles.append(("shard", s, e))
    if config.vision is not None and parallel.vision_resources is not None:
        bundles.append(dict(parallel.vision_resources))
        roles.append(("vision", 0, None))
    return bundles, roles
