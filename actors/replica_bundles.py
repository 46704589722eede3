"""The Ray resources one Serve replica holds: its own bundle first, then one per model actor
(stages, routers, expert shards, the vision encoder). Ray-free, so `k3ray serve` checks a layout
against the machine before it imports Ray."""

from __future__ import annotations

import os

from k3ray.actors.protocol import ParallelConfig
from k3ray.actors.serve_config import ServeArgs, resources
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


def replica_bundles(args: ServeArgs) -> list[dict[str, float]]:
    """placement_group_bundles of a distributed replica: its own bundle, then its actors'; args
    resolved (the checkpoint's config sizes the layout)."""
    assert args.model.model is not None, "resolve() the args first"
    config = ModelConfig.from_json_file(os.path.join(args.model.model, "config.json"))
    bundles, _ = actor_bundles(config, args.parallel_config())
    return [resources(args.parallel.replica_cpus, args.parallel.replica_gpus)] + bundles
