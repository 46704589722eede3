"""VisionEncoder actor: the MoonViT-V2 tower + projector of a checkpoint, turning packed media
into embeddings for the placeholder tokens (one actor per replica, or shared), on the GPU Ray gave
it (else the CPU); the embeddings go back through host memory, to the engine's plan."""

from __future__ import annotations

import ray
import torch

from k3ray.actors.pipeline.actor_device import assigned_device, placement_info
from k3ray.actors.pipeline.restartable import Restartable
from k3ray.vision import encode_media, load_vision


class VisionEncoder(Restartable):
    def __init__(self, checkpoint: str, dtype: str = "float32", torch_threads: int = 1):
        torch.set_num_threads(torch_threads)
        self.device = assigned_device()
        self.model = load_vision(checkpoint, getattr(torch, dtype), device=self.device).eval()

    @torch.no_grad()
    def encode(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """[sum patches, 3, 14, 14] + [n_chunks, 3] -> [n_tokens, text_hidden]."""
        return encode_media(self.model, pixel_values.to(self.device), grid_thws).cpu()

    def ready(self) -> dict:
        return {**placement_info(self.device), "restarted": self.restarted}


class RemoteVisionEncoder:
    """The engine-side handle: same call as encoding in process, answered by the actor."""

    def __init__(self, actor: "ray.actor.ActorHandle", timeout_s: float = 120.0):
        self.actor, self.timeout_s = actor, timeout_s

    def __call__(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        return ray.get(self.actor.encode.remote(pixel_values, grid_thws), timeout=self.timeout_s)
