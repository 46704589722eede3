"""Load the vision tower + projector (`vision_tower.*`, `mm_projector.*`) from a K3 checkpoint.

The tensors share the text model's shards and index; only the shards that hold vision tensors are
opened. Strict like the text loader: every model tensor present with its exact shape, and no
`vision_tower.` / `mm_projector.` key the model does not have. Writing goes through
`k3ray.weights.save_checkpoint(model, path, vision=...)`.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from safetensors import safe_open

from k3ray.config import ModelConfig
from k3ray.vision.model import K3VisionModel, build_vision_model
from k3ray.weights.loader import CONFIG_FILE, read_weight_map
from k3ray.weights.names import is_vision_name

_LISTED = 20


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def has_vision_weights(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at `path` holds any vision tower / projector tensor."""
    return any(is_vision_name(name) for name in read_weight_map(os.fspath(path)))


def load_vision_checkpoint(model: K3VisionModel, path: str | os.PathLike) -> tuple[str, ...]:
    """Fill every tensor of `model` from the checkpoint at `path`; returns the names read."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    weight_map = read_weight_map(path)
    state = model.state_dict()
    missing = [name for name in state if name not in weight_map]
    unexpected = [name for name in weight_map if is_vision_name(name) and name not in state]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing vision keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected vision keys: {_listing(unexpected)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not match the vision model: " + "; ".join(problems))

    by_shard: dict[str, list[str]] = defaultdict(list)
    for name in state:
        by_shard[weight_map[name]].append(name)
    loaded = []
    with torch.no_grad():
        for shard, names in by_shard.items():
            file = os.path.join(path, shard)
            if not os.path.isfile(file):
                raise ValueError(f"shard file {file} named in the index does not exist")
            with safe_open(file, framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise ValueError(f"{file} does not hold {name}, which the index places there")
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(state[name].shape):
                        raise ValueError(
                            f"{name}: checkpoint shape {list(shape)} != expected shape {list(state[name].shape)}"
                        )
                    tensor = f.get_tensor(name)
                    if not tensor.is_floating_point():
                        raise ValueError(f"{name}: checkpoint dtype {tensor.dtype} is not a float type")
                    state[name].copy_(tensor)
                    loaded.append(name)
    return tuple(loaded)


def load_vision(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> K3VisionModel:
    """Build the vision model described by `path/config.json` (its `vision_config`) and load it."""
    path = os.fspath(path)
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise ValueError(f"{config_file} does not exist")
    config = ModelConfig.from_json_file(config_file)
    if config.vision is None:
        raise ValueError(f"{config_file} has no vision_config: this checkpoint has no vision tower")
    model = build_vision_model(config.vision, dtype, seed=None)
    load_vision_checkpoint(model, path)
    return model
