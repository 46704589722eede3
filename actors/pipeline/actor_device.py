"""Where a model actor computes: the GPU Ray assigned it (a fraction of one included), else the CPU.

Ray sets CUDA_VISIBLE_DEVICES to an actor's GPUs, so its first GPU is CUDA's current device; an
actor given no GPUs stays on the CPU even where the node has some (Ray no longer hides them from it).
"""

from __future__ import annotations

import importlib.util

import ray
import torch

from k3ray.device import resolve_device


def assigned_device() -> torch.device:
    """cuda:<current> when Ray gave this actor GPUs, else the CPU."""
    return resolve_device("cuda") if ray.get_gpu_ids() else torch.device("cpu")


def placement_info(device: torch.device) -> dict:
    """What the runner decides the tensor path between actors from: the node, the GPUs Ray gave
    the actor (ids on that node), and whether Ray's NCCL transport (it needs cupy) and NIXL transport (it
    needs nixl) can run here."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "device": str(device),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "nccl": device.type == "cuda" and importlib.util.find_spec("cupy") is not None,
            "nixl": importlib.util.find_spec("nixl") is not None}
