"""K3's feed-forward blocks: the dense SiTU-GLU MLP (layer 0, shared experts) and the Stable
LatentMoE (fp32 sigmoid router with selection-only bias, latent down-projection, routed SiTU-GLU
experts, RMSNorm over the combined latent, up-projection, plus the shared MLP on the input)."""

from __future__ import annotations

import torch
from torch import nn

from k3ray.kernels.moe import moe_experts, route, situ_glu
from k3ray.kernels.moe.cpu import fuse_every_expert
from k3ray.kernels.moe.mxfp4 import dequantize_mxfp4
from k3ray.models.norm import RMSNorm

# CPU MXFP4 experts whose dequantised weights fit this keep them (exact), instead of dequantising
# on every call, which dominated small CPU expert calls; K3-sized expert sets stay packed
DEQUANTIZED_CACHE_BYTES = 64 << 20


class SituMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, beta: float, linear_beta: float, dtype: torch.dtype):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, scaling: float, dtype):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = x.float() @ self.weight.float().T  # [T, E] fp32
        return route(logits, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)


class LocalExperts(nn.Module):
    """Routed experts [start, start + count) of one MoE layer, stacked per projection.

    bf16 format: w1, w3 [E, I, Dl], w2 [E, Dl, I]. MXFP4: w*_packed [E, out, in/2] uint8 and
    w*_scale [E, out, in/32] uint8 buffers, dequantised inside the expert kernel."""

    def __init__(self, start: int, count: int, latent: int, intermediate: int, fmt: str,
                 beta: float, linear_beta: float, dtype: torch.dtype):
        super().__init__()
        self.start, self.count, self.fmt = start, count, fmt
        self.beta, self.linear_beta = beta, linear_beta
        shapes = {"w1": (intermediate, latent), "w3": (intermediate, latent), "w2": (latent, intermediate)}
        for name, (o, i) in shapes.items():
            if fmt == "mxfp4":
                self.register_buffer(f"{name}_packed", torch.zeros(count, o, i // 2, dtype=torch.uint8))
                self.register_buffer(f"{name}_scale", torch.full((count, o, i // 32), 127, dtype=torch.uint8))
            else:
                setattr(self, name, nn.Parameter(torch.empty(count, o, i, dtype=dtype)))
        self._dequantized: dict[tuple, torch.Tensor] = {}
        self._fused: tuple[tuple, tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def weights(self, name: str):
        if self.fmt == "mxfp4":
            return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        return getattr(self, name)

    def _cpu_weights(self, name: str, dtype: torch.dtype):
        """MXFP4 weights as a dense [E, out, in] copy when small enough (keyed by the buffers'
        version counters, so loading new weights in place invalidates it), else packed."""
        packed, scale = self.weights(name)
        if packed.numel() * 2 * dtype.itemsize > DEQUANTIZED_CACHE_BYTES:
            return packed, scale
        key = (name, dtype, packed._version, scale._version)
        if key not in self._dequantized:
            self._dequantized = {k: v for k, v in self._dequantized.items() if k[:2] != key[:2]}
            self._dequantized[key] = dequantize_mxfp4(packed, scale, dtype)
        return self._dequantized[key]

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, Dl] -> partial y [T, Dl] fp32 from the experts held here."""
        if self.fmt == "mxfp4" and h.device.type == "cpu":
            w1, w3, w2 = (self._cpu_weights(name, h.dtype) for name in ("w1", "w3", "w2"))
        else:
            w1, w3, w2 = (self.weights(name) for name in ("w1", "w3", "w2"))
        return moe_experts(h, ids, weights, w1, w3, w2, self.beta, self.linear_beta, self.start,
                           lambda: self._every_expert_weights(w1, w3, w2))

    def _every_expert_weights(self, w1, w3, w2) -> tuple[torch.Tensor, torch.Tensor]:
        """fuse_every_expert(w1, w3, w2), kept while these tensors (held here, so never a new one at
        the same address) and their versions last (an inference-mode tensor, such as a dequantised
        copy, has none; those copies are never written)."""
        tensors = (w1, w3, w2)
        versions = tuple(-1 if w.is_inference() else w._version for w in tensors)
        cached = self._fused
        if cached is None or any(a is not b for a, b in zip(cached[0], tensors)) or cached[1] != versions:
            self._fused = cached = tensors, versions, fuse_every_expert(w1, w3, w2)
        return cached[2]


class StableLatentMoE(nn.Module):
    def __init__(self, hidden_size: int, latent: int, num_experts: int, top_k: int, intermediate: int,
                 shared_intermediate: int, renormalize: bool, scaling: float, use_norm: bool, norm_eps: float,
                 fmt: str, beta: float, linear_beta: float, dtype: torch.dtype,
                 expert_range: tuple[int, int] | None = None):
        super().__init__()
        e0, e1 = expert_range or (0, num_experts)
        self.gate = Router(hidden_size, num_experts, top_k, renormalize, scaling, dtype)
        self.routed_expert_down_proj = nn.Linear(hidden_size, latent, bias=False, dtype=dtype)
        self.routed_expert_up_proj = nn.Linear(latent, hidden_size, bias=False, dtype=dtype)
        self.routed_expert_norm = RMSNorm(latent, norm_eps, dtype) if use_norm else None
        self.experts = LocalExperts(e0, e1 - e0, latent, intermediate, fmt, beta, linear_beta, dtype)
        self.shared_experts = (
            SituMLP(hidden_size, shared_intermediate, beta, linear_beta, dtype) if shared_intermediate else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = self.routed_expert_down_proj(x)  # [T, Dl]; the router does not see h
        y = self.experts(h, ids, weights).to(x.dtype)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        out = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
