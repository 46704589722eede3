"""CPU grouped expert computation: one sort groups the (token, slot) pairs by expert, each used
expert's weights are dequantised once and applied to its rows as plain GEMMs, and one
index_add combines the weighted outputs (in the same order as the reference loop). A small
decode batch over dense weights instead gathers each pair's expert weights and runs three batched
GEMMs: a handful of ops instead of a dozen per used expert, which is what small calls cost; and
when rows x experts is smaller still (fp32), every held expert runs on every row: one GEMM for all
gate and up projections, the activations scaled by a dense routing matrix (0 where a row is not
routed), one GEMM for the down projections and their sum."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from k3ray.kernels.moe.naive import expert_weight, situ_glu

GATHER_MAX_ELEMENTS = 1 << 18  # gathered weight elements (pairs x 3 matrices) of the batched path
# rows x held experts x 3 I Dl: up to this, fp32 runs every held expert on every row (tiny K3 decode
# and short prefill: ~2x faster than gathering here; the gather wins again from ~4M with 2 of 8 routed)
EVERY_EXPERT_MAX_MACS = 1 << 20


def _num_experts(w) -> int:
    return (w[0] if isinstance(w, tuple) else w).shape[0]


def moe_experts_cpu(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1, w3, w2,
    beta: float,
    linear_beta: float,
    expert_offset: int = 0,
    every_expert_weights: Callable[[], EveryExpertWeights] | None = None,
) -> torch.Tensor:
    """y [T, Dl] fp32 = sum_k weights[:, k] * E_{ids[:, k]}(h) over experts [expert_offset,
    expert_offset + E_local); w1, w3 [E, I, Dl], w2 [E, Dl, I], each dense or an MXFP4 pair.
    every_expert_weights: a caller's cache of fuse_every_expert(w1, w3, w2, beta, linear_beta),
    asked for only when the every-expert path runs."""
    T, top_k = ids.shape
    E = _num_experts(w1)
    dense = not isinstance(w1, tuple) and not isinstance(w2, tuple) and not isinstance(w3, tuple)
    fp32 = dense and {h.dtype, w1.dtype, w3.dtype, w2.dtype} == {torch.float32}
    if fp32 and E and 3 * T * w1.numel() <= EVERY_EXPERT_MAX_MACS:
        fused = every_expert_weights() if every_expert_weights else fuse_every_expert(w1, w3, w2, beta, linear_beta)
        return _every_expert(h, ids, weights, expert_offset, fused)
    local = ids.reshape(-1).long() - expert_offset  # [T * k]
    held = ((local >= 0) & (local < E)).nonzero().squeeze(1)
    order = torch.argsort(local[held], stable=True)
    pairs = held[order]  # pair indices grouped by expert, token order inside a group
    tok = pairs // top_k
    x = h[tok]  # [P, Dl]
    if dense and pairs.numel() * (w1[0].numel() + w3[0].numel() + w2[0].numel()) <= GATHER_MAX_ELEMENTS:
        out = _gathered(x, local[pairs], w1, w3, w2, beta, linear_beta)
        out *= weights.reshape(-1)[pairs, None].float()
        return torch.zeros(T, h.shape[1], dtype=torch.float32).index_add_(0, tok, out)
    counts = torch.bincount(local[pairs], minlength=E).tolist()
    out = torch.empty(pairs.numel(), h.shape[1], dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = x[start : start + n]
        a = situ_glu(xe @ expert_weight(w1, e, h.dtype).T, xe @ expert_weight(w3, e, h.dtype).T, beta, linear_beta)
        out[start : start + n] = a @ expert_weight(w2, e, h.dtype).T
        start += n
    out *= weights.reshape(-1)[pairs, None].float()
    return torch.zeros(T, h.shape[1], dtype=torch.float32).index_add_(0, tok, out)


class EveryExpertWeights(NamedTuple):
    """Every held expert as the every-expert path's operands (E experts of width I)."""

    w13t: torch.Tensor  # [Dl, 2 E I]: all gate projections, then all up projections
    divisors: torch.Tensor  # [2 E I]: beta under the gate columns, linear_beta under the up ones
    w2c: torch.Tensor  # [E I, Dl]: the down projections stacked along K, times beta * linear_beta
    num_experts: int


def fuse_every_expert(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, beta: float,
                      linear_beta: float) -> EveryExpertWeights:
    """Dense w1, w3 [E, I, Dl], w2 [E, Dl, I] -> the every-expert operands. SiTU's two outer
    constants move into w2c (one product per weight, once), so a call spends no op on them."""
    E, I, Dl = w1.shape
    with torch.no_grad():  # an inference cache: nothing differentiates through it
        w13t = torch.cat([w1.reshape(E * I, Dl), w3.reshape(E * I, Dl)]).T.contiguous()
        divisors = torch.cat([torch.full((E * I,), beta), torch.full((E * I,), linear_beta)]).to(w13t.dtype)
        w2c = w2.transpose(1, 2).reshape(E * I, Dl) * (beta * linear_beta)
    return EveryExpertWeights(w13t, divisors, w2c.contiguous(), E)


def _every_expert(h, ids, weights, expert_offset: int, fused: EveryExpertWeights) -> torch.Tensor:
    """h [T, Dl], ids [T, k] -> y [T, Dl] fp32: every held expert on every row, each expert's
    activations scaled by the row's routing weight for it (0 where the row is not routed there),
    so one GEMM over [E I] projects and sums them. A decode step's call is a few dozen
    microseconds of op overhead, so this counts ops: SiTU(g, u) / (beta linear_beta) =
    tanh(g / beta) sigmoid(g) tanh(u / linear_beta) in five, on one division and one tanh."""
    T, E = h.shape[0], fused.num_experts
    EI = fused.w2c.shape[0]
    slot = (ids.long() - (expert_offset - 1)).clamp_(0, E + 1)  # [T, k]: 1..E held, 0 / E + 1 elsewhere
    gate = torch.zeros(T, E + 2, dtype=torch.float32).scatter_add_(1, slot, weights.float())  # [T, E + 2]
    gu = h @ fused.w13t  # [T, 2 E I]: g | u
    t_g, t_u = (gu / fused.divisors).tanh_().chunk(2, dim=1)  # [T, E I] each
    a = t_g.mul_(gu[:, :EI].sigmoid_()).mul_(t_u)  # [T, E I], row stride 2 E I
    return (a.view(T, E, EI // E) * gate[:, 1 : E + 1, None]).view(T, EI) @ fused.w2c


def _gathered(x: torch.Tensor, experts: torch.Tensor, w1, w3, w2, beta: float, linear_beta: float) -> torch.Tensor:
    """x [P, Dl] rows, experts [P] local ids, dense weights -> each row through its expert, fp32 [P, Dl]."""
    xb = x[:, None, :]  # [P, 1, Dl]
    g = torch.bmm(xb, w1[experts].to(x.dtype).transpose(1, 2))  # [P, 1, I]
    u = torch.bmm(xb, w3[experts].to(x.dtype).transpose(1, 2))
    a = situ_glu(g, u, beta, linear_beta)
    return torch.bmm(a, w2[experts].to(x.dtype).transpose(1, 2))[:, 0].float()  # [P, Dl]
