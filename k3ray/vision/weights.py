"""Load the vision tower + projector (`vision_tower.*`, `mm_projector.*`) from a K3 checkpoint.

The tensors share the text model's shards and index; only the shards that hold vision tensors are
opened. Strict like the text loader: every model tensor present with its exact shape, and no
`vision_tower.` / `mm_projector.` key the model does not have. Writing goes through
`k3ray.weights.save_checkpoint(model, path, vision=...)`.
"""

from __future__ import annotations

import os

import torch

from k3ray.device import DeviceLike, resolve_device
from k3ray.vision.model import K3VisionModel, build_vision_model
from k3ray.weights.checkpoint_dir import (
    CONFIG_FILE,
    check_keys,
    copy_from_shard,
    group_by_shard,
    open_weight_map,
    read_config,
    read_weight_map,
)
from k3ray.weights.names import is_vision_name


def has_vision_weights(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at `path` holds any vision tower / projector tensor."""
    return any(is_vision_name(name) for name in read_weight_map(os.fspath(path)))


def load_vision_checkpoint(model: K3VisionModel, path: str | os.PathLike) -> tuple[str, ...]:
    """Fill every tensor of `model` from the checkpoint at `path`; returns the names read."""
    path, weight_map = open_weight_map(path)
    state = model.state_dict()
    missing = [name for name in state if name not in weight_map]
    unexpected = [name for name in weight_map if is_vision_name(name) and name not in state]
    check_keys(path, "the vision model", missing, unexpected, what="vision keys")

    by_shard = group_by_shard(path, weight_map, state, lambda name: name)
    for shard, names in by_shard.items():
        copy_from_shard(os.path.join(path, shard), [(name, state[name]) for name in names], _check_float)
    return tuple(name for names in by_shard.values() for name in names)


def _check_float(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: checkpoint dtype {tensor.dtype} is not a float type")


def load_vision(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: DeviceLike = "cpu") -> K3VisionModel:
    """Build the vision model described by `path/config.json` (its `vision_config`) on `device`
    and load it straight onto it."""
    path = os.fspath(path)
    config = read_config(path)
    if config.vision is None:
        raise ValueError(f"{os.path.join(path, CONFIG_FILE)} has no vision_config: this checkpoint has no vision tower")
    model = build_vision_model(config.vision, dtype, seed=None, device=resolve_device(device))
    load_vision_checkpoint(model, path)
    return model
