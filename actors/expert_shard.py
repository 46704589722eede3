"""ExpertShard actor: the routed experts [e0, e1) of one stage's MoE layers (MXFP4 or bf16), on
the GPU Ray gave it (else the CPU). Rows arrive and partial outputs leave through host memory (see
moe_dispatch.RemoteExperts)."""

from __future__ import annotations

import ray
import torch
from torch import nn

from k3ray.actors.actor_device import assigned_device, placement_info
from k3ray.actors.wire import Bundle, pack_raw, unpack_tagged
from k3ray.config import ModelConfig


class ExpertContainer(nn.Module):
    """Only `model.layers.{i}.block_sparse_moe.experts` for the MoE layers in a range, named as in
    the full model so the checkpoint loader fills exactly these tensors."""

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int], expert_range: tuple[int, int], dtype):
        super().__init__()
        from k3ray.models.k3 import local_experts

        self.config, self.expert_range = config, expert_range
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict()
        experts = local_experts(config, dtype, expert_range)
        for i in range(*layer_range):
            if not config.is_moe_layer(i):
                continue
            holder = nn.Module()
            holder.block_sparse_moe = nn.Module()
            holder.block_sparse_moe.experts = experts(i)
            self.model.layers[str(i)] = holder

    def experts(self, layer_idx: int):
        return self.model.layers[str(layer_idx)].block_sparse_moe.experts


class ExpertShard:
    def __init__(self, checkpoint: str, layer_range: tuple[int, int], expert_range: tuple[int, int],
                 dtype: str = "float32", torch_threads: int = 1):
        from k3ray.weights import load_checkpoint

        torch.set_num_threads(torch_threads)
        config = ModelConfig.from_json_file(f"{checkpoint}/config.json")
        self.device = assigned_device()
        with torch.device(self.device):
            self.container = ExpertContainer(config, layer_range, expert_range, getattr(torch, dtype))
        load_checkpoint(self.container, checkpoint)  # straight onto the container's device
        self.layer_range, self.expert_range = layer_range, expert_range

    # per-layer calls (hundreds a second) would churn Ray's bounded task-event table and evict the
    # tasks worth inspecting; a failed call still raises in its caller
    @ray.method(enable_task_events=False)
    @torch.inference_mode()  # as the local executor runs
    def compute(self, rows: Bundle) -> Bundle:
        """rows = (h [T, Dl], ids [T, k], weights [T, k]) routed here, tagged with the layer (one
        argument: Ray passes that cheapest) -> partial y [T, Dl] fp32 from experts [e0, e1), raw
        (wire.pack_raw: the caller knows its shape)."""
        layer_idx, tensors = unpack_tagged(rows)
        return pack_raw(self.container.experts(layer_idx)(*(t.to(self.device) for t in tensors)))

    @ray.method(enable_task_events=False)
    def relay(self, rows: Bundle) -> Bundle:
        """Hand the rows straight back (k3ray bench cluster: Ray's own cost of a dispatch's calls)."""
        return rows

    def ready(self) -> dict:
        return {"layers": self.layer_range, "experts": self.expert_range, **placement_info(self.device)}
