"""ExpertShard actor: the routed experts [e0, e1) of one stage's MoE layers (MXFP4 or bf16), on
the GPU Ray gave it (else the CPU), plus replicas of hot experts the router places on it
(pipeline/expert_placement.py), loaded in the background. Rows arrive and partial outputs leave through host
memory (see moe_dispatch.RemoteExperts)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ray
import torch
from torch import nn

from k3ray.actors.pipeline.actor_device import assigned_device, placement_info
from k3ray.actors.pipeline.protocol import StageFailure
from k3ray.actors.pipeline.restartable import Restartable
from k3ray.actors.pipeline.wire import Bundle, pack_raw, unpack_tagged
from k3ray.config import ModelConfig
from k3ray.models.k3 import local_experts
from k3ray.weights import load_checkpoint


class ExpertContainer(nn.Module):
    """Only `model.layers.{i}.block_sparse_moe.experts` for the MoE layers in a range, named as in
    the full model so the checkpoint loader fills exactly these tensors."""

    def __init__(self, config: ModelConfig, layer_range: tuple[int, int], expert_range: tuple[int, int], dtype):
        super().__init__()
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


class ExpertShard(Restartable):
    def __init__(self, checkpoint: str, layer_range: tuple[int, int], expert_range: tuple[int, int],
                 dtype: str = "float32", torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        self.config = ModelConfig.from_json_file(f"{checkpoint}/config.json")
        self.checkpoint, self.dtype = checkpoint, getattr(torch, dtype)
        self.device = assigned_device()
        self.layer_range, self.expert_range = layer_range, expert_range
        self.container = self._load(expert_range)
        self.replicas: dict[int, ExpertContainer] = {}  # expert -> its replica; replaced whole, never mutated
        self.loader = ThreadPoolExecutor(1)  # replicas load beside the compute calls

    def _load(self, expert_range: tuple[int, int]) -> ExpertContainer:
        with torch.device(self.device):
            container = ExpertContainer(self.config, self.layer_range, expert_range, self.dtype)
        load_checkpoint(container, self.checkpoint)  # straight onto the container's device
        return container

    # per-layer calls (hundreds a second) would churn Ray's bounded task-event table and evict the
    # tasks worth inspecting; a failed call still raises in its caller
    @ray.method(enable_task_events=False)
    @torch.inference_mode()  # as the local executor runs
    def compute(self, rows: Bundle) -> Bundle:
        """rows = (h [T, Dl], ids [T, k], weights [T, k]) routed here, tagged with the layer (one
        argument: Ray passes that cheapest) -> partial y [T, Dl] fp32 from experts [e0, e1), raw
        (wire.pack_raw: the caller knows its shape). With replicas placed, the rows carry a fourth
        tensor, the replicas [R] to compute too, and the pairs another copy computes have id -1."""
        layer_idx, tensors = unpack_tagged(rows)
        h, ids, weights = (t.to(self.device) for t in tensors[:3])
        y = self.container.experts(layer_idx)(h, ids, weights)
        if len(tensors) > 3:
            held = self.replicas
            for e in set(tensors[3].tolist()) & set(ids.flatten().tolist()):
                if e not in held:  # e.g. a restarted shard: a silent 0 would change outputs
                    raise StageFailure(f"expert shard {self.expert_range} holds no replica of expert {e}")
                y += held[e].experts(layer_idx)(h, ids, weights)
        return pack_raw(y)

    def add_replicas(self, experts: list[int]) -> None:
        """Start loading replicas of `experts` (the ones not held yet) in the background; the
        router asks `held_replicas` until they are in."""
        missing = [e for e in experts if e not in self.replicas and not self.expert_range[0] <= e < self.expert_range[1]]
        if missing:
            self.loader.submit(self._load_replicas, missing)

    def _load_replicas(self, experts: list[int]) -> None:
        loaded = {e: self._load((e, e + 1)) for e in experts}
        self.replicas = {**self.replicas, **loaded}

    def held_replicas(self) -> list[int]:
        return sorted(self.replicas)

    def keep_replicas(self, experts: list[int]) -> None:
        """Drop the replicas no placement in use names any more (after the stage switched)."""
        self.replicas = {e: c for e, c in self.replicas.items() if e in experts}

    @ray.method(enable_task_events=False)
    def relay(self, rows: Bundle) -> Bundle:
        """Hand the rows straight back (k3ray bench cluster: Ray's own cost of a dispatch's calls)."""
        return rows

    def ready(self) -> dict:
        return {"layers": self.layer_range, "experts": self.expert_range, **placement_info(self.device),
                "restarted": self.restarted}
