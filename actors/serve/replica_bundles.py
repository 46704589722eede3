"""The Ray resources one Serve replica holds: its own bundle first, then one per model actor
(pipeline/actor_bundles.py). Ray-free, so `k3ray serve` checks a layout
against the machine before it imports Ray."""

from __future__ import annotations

import os

from k3ray.actors.pipeline.actor_bundles import actor_bundles
from k3ray.actors.serve.config import ServeArgs, resources
from k3ray.config import ModelConfig


def replica_bundles(args: ServeArgs) -> list[dict[str, float]]:
    """placement_group_bundles of a distributed replica: its own bundle, then its actors'; args
    resolved (the checkpoint's config sizes the layout)."""
    assert args.model.model is not None, "resolve() the args first"
    config = ModelConfig.from_json_file(os.path.join(args.model.model, "config.json"))
    bundles, _ = actor_bundles(config, args.parallel_config())
    return [resources(args.parallel.replica_cpus, args.parallel.replica_gpus)] + bundles
