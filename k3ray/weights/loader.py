"""Load a K3 safetensors checkpoint (sharded with an index, or one `model.safetensors`) into a
K3ForCausalLM or a slice of it (a layer range, an expert range).

A slice opens only the shards that hold its tensors and reads only those tensors, so a pipeline
stage or expert shard never touches other layers' or experts' data. Loading is strict: every
model tensor is filled, every checkpoint key belongs to the full model (or the vision tower),
shapes match exactly.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
from safetensors import safe_open

from k3ray.config import ModelConfig
from k3ray.models.init import build_model
from k3ray.models.k3 import K3ForCausalLM
from k3ray.weights.names import TensorRef, is_stacked, is_vision_name, model_tensor_refs, parse_checkpoint_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_LISTED = 20  # names shown in an error message before "... and N more"


@dataclass(frozen=True)
class LoadReport:
    path: str
    loaded: tuple[str, ...]  # checkpoint tensors read, in load order
    shards: tuple[str, ...]  # shard files opened
    skipped_vision: tuple[str, ...]  # vision tower / projector tensors: not part of the text model
    num_outside_slice: int  # tensors of layers or experts this model slice does not hold


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def read_weight_map(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> shard file name (relative to `path`)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f).get("weight_map")
            except (json.JSONDecodeError, AttributeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: `weight_map` must map tensor names to shard file names")
        return weight_map
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise ValueError(f"{path}: holds neither {INDEX_FILE} nor {SINGLE_FILE}")


def _full_model_names(config: ModelConfig) -> frozenset[str]:
    with torch.device("meta"):
        return frozenset(K3ForCausalLM(config).state_dict())


def _belongs_to_full_model(name: str, full_names: frozenset[str], num_experts: int) -> bool:
    parsed = parse_checkpoint_name(name)
    if parsed is None:
        return False
    param, expert = parsed
    if param not in full_names or is_stacked(param) != (expert is not None):
        return False
    return expert is None or expert < num_experts


def load_checkpoint(model: K3ForCausalLM, path: str | os.PathLike) -> LoadReport:
    """Fill every tensor of `model` (a whole model or a slice) from the checkpoint at `path`."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    weight_map = read_weight_map(path)
    refs = model_tensor_refs(model, model.expert_range[0])
    held = {ref.checkpoint for ref in refs}

    full_names = _full_model_names(model.config)
    vision, unexpected, outside = [], [], 0
    for name in weight_map:
        if name in held:
            continue
        if is_vision_name(name):
            vision.append(name)
        elif _belongs_to_full_model(name, full_names, model.config.num_experts):
            outside += 1
        else:
            unexpected.append(name)
    missing = [ref.checkpoint for ref in refs if ref.checkpoint not in weight_map]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys (not tensors of this K3 config): {_listing(unexpected)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model: " + "; ".join(problems))

    by_shard: dict[str, list[TensorRef]] = defaultdict(list)
    for ref in refs:
        by_shard[weight_map[ref.checkpoint]].append(ref)
    for shard in by_shard:
        if not os.path.isfile(os.path.join(path, shard)):
            raise ValueError(f"shard file {os.path.join(path, shard)} named in {INDEX_FILE} does not exist")

    state = model.state_dict()
    loaded = []
    with torch.no_grad():
        for shard, shard_refs in by_shard.items():
            loaded += _load_shard(os.path.join(path, shard), shard_refs, state)
    return LoadReport(path, tuple(loaded), tuple(by_shard), tuple(vision), outside)


def _load_shard(file: str, refs: list[TensorRef], state: dict[str, torch.Tensor]) -> list[str]:
    with safe_open(file, framework="pt") as f:
        present = set(f.keys())
        for ref in refs:
            if ref.checkpoint not in present:
                raise ValueError(f"{file} does not hold {ref.checkpoint}, which the index places there")
            target = state[ref.param] if ref.local is None else state[ref.param][ref.local]
            shape = tuple(f.get_slice(ref.checkpoint).get_shape())
            if shape != tuple(target.shape):
                raise ValueError(
                    f"{ref.checkpoint}: checkpoint shape {list(shape)} != expected shape {list(target.shape)}"
                )
            tensor = f.get_tensor(ref.checkpoint)
            if (tensor.dtype == torch.uint8) != (target.dtype == torch.uint8):
                raise ValueError(
                    f"{ref.checkpoint}: checkpoint dtype {tensor.dtype} cannot fill a {target.dtype} tensor"
                )
            target.copy_(tensor)
    return [ref.checkpoint for ref in refs]


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    layer_range: tuple[int, int] | None = None,
    expert_range: tuple[int, int] | None = None,
) -> K3ForCausalLM:
    """Build the model (or slice) described by `path/config.json` and load its weights."""
    path = os.fspath(path)
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise ValueError(f"{config_file} does not exist")
    config = ModelConfig.from_json_file(config_file)
    model = build_model(config, dtype, seed=None, layer_range=layer_range, expert_range=expert_range)
    load_checkpoint(model, path)
    return model
