"""Write a whole K3ForCausalLM as a checkpoint in K3's published layout: `config.json`, shards
`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`, with the published names
and dtypes (bf16, the fp32 list, MXFP4 experts as stored in the model's packed buffers)."""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from k3ray.models.k3 import K3ForCausalLM
from k3ray.weights.loader import CONFIG_FILE, INDEX_FILE
from k3ray.weights.names import TensorRef, model_tensor_refs, published_dtype

DEFAULT_MAX_SHARD_BYTES = 5_000_000_000


def _shard_plan(refs: list[TensorRef], state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[TensorRef]]:
    """Consecutive tensors packed greedily into shards of at most max_shard_bytes (a larger
    tensor gets a shard of its own)."""
    shards: list[list[TensorRef]] = [[]]
    size = 0
    for ref in refs:
        shape = state[ref.param].shape if ref.local is None else state[ref.param].shape[1:]
        nbytes = math.prod(shape) * published_dtype(ref.checkpoint).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ref)
        size += nbytes
    return shards


def _published_tensor(ref: TensorRef, state: dict[str, torch.Tensor]) -> torch.Tensor:
    tensor = state[ref.param] if ref.local is None else state[ref.param][ref.local]
    dtype = published_dtype(ref.checkpoint)
    assert (dtype == torch.uint8) == (tensor.dtype == torch.uint8), (ref.checkpoint, tensor.dtype)
    return tensor.detach().to(dtype=dtype, copy=True).contiguous()  # copies: shards must not share storage


def save_checkpoint(
    model: K3ForCausalLM, path: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> tuple[str, ...]:
    """Write `model` (a whole model, not a slice) to directory `path`; returns the shard names."""
    c = model.config
    if model.layer_range != (0, c.num_layers) or model.expert_range != (0, c.num_experts):
        raise ValueError(
            f"save_checkpoint needs a whole model, got layer_range={model.layer_range} "
            f"expert_range={model.expert_range} (full: (0, {c.num_layers}), (0, {c.num_experts}))"
        )
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(c.to_hf(), f, indent=2)
        f.write("\n")

    state = model.state_dict()
    plan = _shard_plan(model_tensor_refs(model, 0), state, max_shard_bytes)
    names = tuple(f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan)))
    weight_map, total = {}, 0
    for shard_name, refs in zip(names, plan):
        tensors = {ref.checkpoint: _published_tensor(ref, state) for ref in refs}
        save_file(tensors, os.path.join(path, shard_name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: shard_name for name in tensors})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return names
