"""Write a whole K3ForCausalLM as a checkpoint in K3's published layout: `config.json`, shards
`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`, with the published names
and dtypes (bf16, the fp32 list, MXFP4 experts as stored in the model's packed buffers). An optional
vision model (k3ray.vision.K3VisionModel, whose state_dict names are the published `vision_tower.*` /
`mm_projector.*` names) is written into the same shards after the text tensors."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from k3ray.models.k3 import K3ForCausalLM
from k3ray.weights.checkpoint_dir import CONFIG_FILE, INDEX_FILE
from k3ray.weights.names import is_vision_name, model_tensor_refs, published_dtype

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000


def _shard_plan(tensors: list[tuple[str, torch.Tensor]], max_shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors packed greedily into shards of at most max_shard_bytes (a larger
    tensor gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * published_dtype(name).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    return shards


def _published_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    dtype = published_dtype(name)
    assert (dtype == torch.uint8) == (tensor.dtype == torch.uint8), (name, tensor.dtype)
    return tensor.detach().to(dtype=dtype, copy=True).contiguous()  # copies: shards must not share storage


def _named_tensors(model: K3ForCausalLM, vision: nn.Module | None) -> list[tuple[str, torch.Tensor]]:
    state = model.state_dict()
    out = [
        (ref.checkpoint, state[ref.param] if ref.local is None else state[ref.param][ref.local])
        for ref in model_tensor_refs(model, 0)
    ]
    if vision is not None:
        out += list(vision.state_dict().items())
    return out


def _check_vision(model: K3ForCausalLM, vision: nn.Module) -> None:
    if model.config.vision is None or getattr(vision, "config", None) != model.config.vision:
        raise ValueError(
            "the vision model's config must equal the text model's config.vision "
            f"(got {getattr(vision, 'config', None)!r} vs {model.config.vision!r})"
        )
    foreign = [name for name in vision.state_dict() if not is_vision_name(name)]
    if foreign:
        raise ValueError(f"vision tensors must be named vision_tower.* or mm_projector.*, got {foreign[:3]}")


def save_checkpoint(
    model: K3ForCausalLM,
    path: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    vision: nn.Module | None = None,
) -> tuple[str, ...]:
    """Write `model` (a whole model, not a slice) and, if given, its vision tower + projector to
    directory `path`; returns the shard names."""
    c = model.config
    if model.layer_range != (0, c.num_layers) or model.expert_range != (0, c.num_experts):
        raise ValueError(
            f"save_checkpoint needs a whole model, got layer_range={model.layer_range} "
            f"expert_range={model.expert_range} (full: (0, {c.num_layers}), (0, {c.num_experts}))"
        )
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    if vision is not None:
        _check_vision(model, vision)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(c.to_hf(), f, indent=2)
        f.write("\n")

    plan = _shard_plan(_named_tensors(model, vision), max_shard_bytes)
    names = tuple(f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan)))
    weight_map, total = {}, 0
    for shard_name, entries in zip(names, plan):
        tensors = {name: _published_tensor(name, tensor) for name, tensor in entries}
        save_file(tensors, os.path.join(path, shard_name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: shard_name for name in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return names
