"""K3's feed-forward blocks: the dense SiTU-GLU MLP (layer 0, shared experts) and the Stable
LatentMoE (fp32 sigmoid expert gate with selection-only bias, latent down-projection, routed SiTU-GLU
experts, RMSNorm over the combined latent, up-projection, plus the shared MLP on the input)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

from k3ray.kernels.moe import moe_experts, select_experts, situ_glu
from k3ray.kernels.moe.experts_cpu import EveryExpertWeights, fuse_every_expert
from k3ray.kernels.moe.mxfp4 import dequantize_mxfp4
from k3ray.models.norm import RMSNorm

# CPU MXFP4 experts whose dequantised weights fit this keep them (exact), instead of dequantising
# on every call, which dominated small CPU expert calls; K3-sized expert sets stay packed
DEQUANTIZED_CACHE_BYTES = 64 << 20
PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down: the order the expert kernels take them in


class SituMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, beta: float, linear_beta: float, dtype: torch.dtype):
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


class ExpertGate(nn.Module):
    """Picks each token's routed experts and their weights (the checkpoint's `gate`)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, scaling: float, dtype):
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] fp32, expert ids [T, k])."""
        logits = x.float() @ self.weight.float().T  # [T, E] fp32
        return select_experts(logits, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)


class ExpertBackend(nn.Module, ABC):
    """Where a MoE layer's routed experts run: LocalExperts in this process, or a backend that sends
    the latent rows to experts held elsewhere (the Ray stages' remote experts)."""

    @abstractmethod
    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, Dl], ids / weights [T, k] -> y [T, Dl] fp32 = sum over k of weights * expert(h)."""


ExpertsFactory = Callable[[int], ExpertBackend]  # MoE layer index -> that layer's experts


class LocalExperts(ExpertBackend):
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
        self._stored_names = [f"{n}_{part}" for n in PROJECTIONS for part in ("packed", "scale")] \
            if fmt == "mxfp4" else list(PROJECTIONS)
        self._cpu_cache: dict[torch.dtype, _CpuOperands] = {}  # all built from the weights _cpu_key names
        self._cpu_key: tuple = ()
        self._cpu_held: tuple[torch.Tensor, ...] = ()

    def weights(self, name: str):
        if self.fmt == "mxfp4":
            return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        return getattr(self, name)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [T, Dl] -> partial y [T, Dl] fp32 from the experts held here."""
        if h.device.type != "cpu":
            w1, w3, w2 = (self.weights(name) for name in PROJECTIONS)
            return moe_experts(h, ids, weights, w1, w3, w2, self.beta, self.linear_beta, self.start)
        cpu = self._cpu_operands(h.dtype)
        return moe_experts(h, ids, weights, *cpu.weights, self.beta, self.linear_beta, self.start,
                           cpu.every_expert_weights)

    def _cpu_operands(self, dtype: torch.dtype) -> _CpuOperands:
        """The CPU kernels' weights for activations of dtype, kept while the stored tensors' memory
        and version counters stay the same (loading new weights in place, replacing a tensor, or
        Module.to swapping a parameter's data invalidates them). One check per call: a per-layer
        call of a decode step is mostly such overhead."""
        table = self._buffers if self.fmt == "mxfp4" else self._parameters  # not nn.Module.__getattr__: ~us each
        stored = [table[name] for name in self._stored_names]
        key = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in stored)  # inference: no counter
        if key != self._cpu_key:
            # the memory the key names stays held, so no later tensor can be given its addresses
            self._cpu_cache, self._cpu_key, self._cpu_held = {}, key, tuple(t.detach() for t in stored)
        entry = self._cpu_cache.get(dtype)
        if entry is None:
            entry = self._cpu_cache[dtype] = _CpuOperands(self._cpu_weights(dtype), self.beta, self.linear_beta)
        return entry

    def _cpu_weights(self, dtype: torch.dtype) -> tuple:
        """(w1, w3, w2): MXFP4 as a dense [E, out, in] copy when small enough (exact), else packed;
        dense weights as stored."""
        if self.fmt != "mxfp4":
            return tuple(self.weights(name) for name in PROJECTIONS)
        out = []
        for name in PROJECTIONS:
            packed, scale = self.weights(name)
            small = packed.numel() * 2 * dtype.itemsize <= DEQUANTIZED_CACHE_BYTES
            out.append(dequantize_mxfp4(packed, scale, dtype) if small else (packed, scale))
        return tuple(out)


class _CpuOperands:
    """One LocalExperts' CPU weights for one activation dtype and, built on first use, their
    every-expert fusion."""

    def __init__(self, weights: tuple, beta: float, linear_beta: float):
        self.weights, self.beta, self.linear_beta = weights, beta, linear_beta
        self.fused: EveryExpertWeights | None = None

    def every_expert_weights(self) -> EveryExpertWeights:
        if self.fused is None:
            self.fused = fuse_every_expert(*self.weights, self.beta, self.linear_beta)
        return self.fused


class StableLatentMoE(nn.Module):
    """`experts` computes the routed experts on the latent rows, here or elsewhere (ExpertBackend)."""

    def __init__(self, hidden_size: int, latent: int, num_experts: int, top_k: int, experts: ExpertBackend,
                 shared_intermediate: int, renormalize: bool, scaling: float, use_norm: bool, norm_eps: float,
                 beta: float, linear_beta: float, dtype: torch.dtype):
        super().__init__()
        self.gate = ExpertGate(hidden_size, num_experts, top_k, renormalize, scaling, dtype)
        self.routed_expert_down_proj = nn.Linear(hidden_size, latent, bias=False, dtype=dtype)
        self.routed_expert_up_proj = nn.Linear(latent, hidden_size, bias=False, dtype=dtype)
        self.routed_expert_norm = RMSNorm(latent, norm_eps, dtype) if use_norm else None
        self.experts = experts
        self.shared_experts = (
            SituMLP(hidden_size, shared_intermediate, beta, linear_beta, dtype) if shared_intermediate else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = self.routed_expert_down_proj(x)  # [T, Dl]; the gate does not see h
        y = self.experts(h, ids, weights).to(x.dtype)
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        out = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
