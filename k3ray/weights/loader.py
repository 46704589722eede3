"""Load a K3 safetensors checkpoint (sharded with an index, or one `model.safetensors`) into a
K3ForCausalLM or a slice of it (a layer range, an expert range).

A slice opens only the shards that hold its tensors and reads only those tensors, so a pipeline
stage or expert shard never touches other layers' or experts' data. Loading is strict: every
model tensor is filled, every checkpoint key belongs to the full model (or the vision tower),
shapes match exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from k3ray.checkpoints import resolve_shipped
from k3ray.config import ModelConfig
from k3ray.device import DeviceLike, resolve_device
from k3ray.models.init import build_model
from k3ray.models.k3 import K3ForCausalLM
from k3ray.weights.checkpoint_dir import check_keys, copy_from_shard, group_by_shard, open_weight_map, read_config
from k3ray.weights.names import is_stacked, is_vision_name, model_tensor_refs, parse_checkpoint_name


@dataclass(frozen=True)
class LoadReport:
    path: str
    loaded: tuple[str, ...]  # checkpoint tensors read, in load order
    shards: tuple[str, ...]  # shard files opened
    skipped_vision: tuple[str, ...]  # vision tower / projector tensors: not part of the text model
    num_outside_slice: int  # tensors of layers or experts this model slice does not hold


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
    path, weight_map = open_weight_map(path)
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
    check_keys(path, "the model", missing, unexpected, unexpected_why=" (not tensors of this K3 config)")

    by_shard = group_by_shard(path, weight_map, refs, lambda ref: ref.checkpoint)
    state = model.state_dict()
    for shard, shard_refs in by_shard.items():
        targets = [(ref.checkpoint, state[ref.param] if ref.local is None else state[ref.param][ref.local])
                   for ref in shard_refs]
        copy_from_shard(os.path.join(path, shard), targets, _check_packing)
    loaded = tuple(ref.checkpoint for shard_refs in by_shard.values() for ref in shard_refs)
    return LoadReport(path, loaded, tuple(by_shard), tuple(vision), outside)


def _check_packing(name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    # MXFP4 experts are stored packed in uint8; nothing else may be
    if (tensor.dtype == torch.uint8) != (target.dtype == torch.uint8):
        raise ValueError(f"{name}: checkpoint dtype {tensor.dtype} cannot fill a {target.dtype} tensor")


def load_model(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    layer_range: tuple[int, int] | None = None,
    expert_range: tuple[int, int] | None = None,
    device: DeviceLike = "cpu",
) -> K3ForCausalLM:
    """Build the model (or slice) described by `path/config.json` (`path` may name a shipped checkpoint)
    on `device` ("auto", "cpu", "cuda", "cuda:N") and load its weights straight onto it (MXFP4 experts
    stay packed)."""
    path = resolve_shipped(path)
    config = read_config(path)
    model = build_model(config, dtype, seed=None, device=resolve_device(device), layer_range=layer_range,
                        expert_range=expert_range)
    load_checkpoint(model, path)
    return model
