"""Capacity planner: split a K3 config into pipeline-stage and expert-shard actors that fit a
device, with the memory of every actor (weights, KDA state, MLA cache), or say why it cannot.

Each stage actor holds contiguous layers (all their non-expert weights and caches; the first
also the embedding, the last the head); each of a stage's `expert_parallel` shard actors holds
an equal slice of that stage's routed experts; one CPU-only router actor per stage."""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3ray.config import ModelConfig

GIB = 2**30

# usable accelerator memory per device (the card minus a runtime reserve is applied separately)
DEVICES: dict[str, int] = {
    "H100": 80 * GIB,
    "H200": 141 * GIB,
    "B200": 180 * GIB,
}


@dataclass(frozen=True)
class PlanRequest:
    config: ModelConfig
    device: str  # H100 | H200 | B200 | CPU
    context_len: int
    concurrency: int
    expert_format: str = "mxfp4"  # or "bf16"
    pipeline: int | None = None  # fixed sizes, or None to search
    expert_parallel: int | None = None
    device_memory_gib: float | None = None  # CPU: host memory per node (required); GPU: override
    utilization: float = 0.9  # fraction of a device usable for weights + caches
    activation_reserve_gib: float = 2.0  # per stage actor: activations of one chunked-prefill step


@dataclass(frozen=True)
class ActorPlan:
    role: str  # "stage" | "expert_shard" | "router"
    stage: int
    layers: tuple[int, int]
    experts: tuple[int, int] | None
    weight_bytes: int
    kda_state_bytes: int
    mla_cache_bytes: int
    other_bytes: int
    devices: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kda_state_bytes + self.mla_cache_bytes + self.other_bytes


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    pipeline: int
    expert_parallel: int
    actors: tuple[ActorPlan, ...]
    device_bytes: int

    @property
    def num_devices(self) -> int:
        return sum(a.devices for a in self.actors)


def _layer_bytes(c: ModelConfig, expert_format: str) -> tuple[list[int], list[int]]:
    """(non-expert weight bytes, routed-expert bytes) per layer, as published (bf16 / fp32 / MXFP4)."""
    D = c.hidden_size
    H, K, W = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
    kda = 2 * (4 * D * H * K + H * K * D + D * K + K * H * K + H * D) + 4 * (3 * H * K * W + H * K + c.kda_a_log_size + K)
    Hm = c.mla_num_heads
    mla = 2 * (D * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * Hm * c.qk_head_dim + D * c.mla_latent_dim
               + c.kv_lora_rank + c.kv_lora_rank * Hm * (c.qk_nope_head_dim + c.v_head_dim)
               + (D * Hm * c.v_head_dim if c.mla_use_output_gate else 0) + Hm * c.v_head_dim * D)
    norms = 2 * 6 * D
    L, I = c.routed_expert_hidden_size, c.moe_intermediate_size
    moe_dense = 2 * (c.num_experts * D + 2 * D * L + L + 3 * D * c.shared_intermediate_size) + 4 * c.num_experts
    per_expert = 3 * L * I
    expert = c.num_experts * (per_expert // 2 + per_expert // 32 if expert_format == "mxfp4" else 2 * per_expert)
    dense, routed = [], []
    for i, t in enumerate(c.layer_types):
        ffn = moe_dense if c.is_moe_layer(i) else 2 * 3 * D * c.intermediate_size
        dense.append((kda if t == "kda" else mla) + norms + ffn)
        routed.append(expert if c.is_moe_layer(i) else 0)
    return dense, routed


def split_range(n: int, p: int) -> list[tuple[int, int]]:
    """[0, n) cut into p contiguous parts whose sizes differ by at most one."""
    base, extra = divmod(n, p)
    out, start = [], 0
    for s in range(p):
        end = start + base + (1 if s < extra else 0)
        out.append((start, end))
        start = end
    return out


def build_plan(req: PlanRequest, pipeline: int, expert_parallel: int) -> Plan:
    c = req.config
    dense, routed = _layer_bytes(c, req.expert_format)
    H, K, W = c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
    embed = 2 * c.vocab_size * c.hidden_size
    actors = []
    for s, (a, b) in enumerate(split_range(c.num_layers, pipeline)):
        kinds = c.layer_types[a:b]
        n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
        weights = sum(dense[a:b]) + (embed if a == 0 else 0) + (embed + 3 * 2 * c.hidden_size if b == c.num_layers else 0)  # lm_head, norm, output AttnRes
        kda_state = req.concurrency * n_kda * (H * K * K * 4 + 3 * H * K * (W - 1) * 2)
        mla = req.concurrency * n_mla * req.context_len * c.mla_latent_dim * 2
        reserve = int(req.activation_reserve_gib * GIB)
        actors.append(ActorPlan("stage", s, (a, b), None, weights, kda_state, mla, reserve, 1))
        stage_experts = sum(routed[a:b])
        for e, (e0, e1) in enumerate(split_range(c.num_experts, expert_parallel)):
            share = stage_experts * (e1 - e0) // c.num_experts
            if share:
                actors.append(ActorPlan("expert_shard", s, (a, b), (e0, e1), share, 0, 0, 0, 1))
        actors.append(ActorPlan("router", s, (a, b), None, 0, 0, 0, 0, 0))
    return Plan(req, pipeline, expert_parallel, tuple(actors), _device_bytes(req))


def _device_bytes(req: PlanRequest) -> int:
    if req.device_memory_gib is not None:
        raw = int(req.device_memory_gib * GIB)
    elif req.device in DEVICES:
        raw = DEVICES[req.device]
    else:
        raise ValueError(f"device {req.device!r} needs --device-memory-gib (CPU nodes have no fixed size)")
    return int(raw * req.utilization)


def problems(plan: Plan) -> list[str]:
    """Reasons the plan cannot run (empty when it fits)."""
    out = []
    for a in plan.actors:
        if a.devices and a.total_bytes > plan.device_bytes:
            what = f"stage {a.stage} (layers {a.layers[0]}-{a.layers[1] - 1})"
            if a.role == "expert_shard":
                what = f"expert shard {a.experts[0]}-{a.experts[1] - 1} of {what}"
            out.append(
                f"{what} needs {a.total_bytes / GIB:.1f} GiB (weights {a.weight_bytes / GIB:.1f}, KDA state "
                f"{a.kda_state_bytes / GIB:.1f}, MLA cache {a.mla_cache_bytes / GIB:.1f}, activations "
                f"{a.other_bytes / GIB:.1f}) > {plan.device_bytes / GIB:.1f} GiB usable on one {plan.request.device}"
            )
    return out


def validate_request(req: PlanRequest) -> None:
    c = req.config
    if req.device not in DEVICES and req.device != "CPU":
        raise ValueError(f"device must be one of {sorted(DEVICES) + ['CPU']}, got {req.device!r}")
    if req.context_len <= 0 or req.context_len > c.max_position_embeddings:
        raise ValueError(f"context_len must be in [1, {c.max_position_embeddings}], got {req.context_len}")
    if req.concurrency <= 0:
        raise ValueError(f"concurrency must be > 0, got {req.concurrency}")
    if req.expert_format not in ("mxfp4", "bf16"):
        raise ValueError(f"expert_format must be 'mxfp4' or 'bf16', got {req.expert_format!r}")
    if req.pipeline is not None and not 1 <= req.pipeline <= c.num_layers:
        raise ValueError(f"pipeline must be in [1, {c.num_layers}], got {req.pipeline}")
    if req.expert_parallel is not None and not 1 <= req.expert_parallel <= c.num_experts:
        raise ValueError(f"expert_parallel must be in [1, {c.num_experts}], got {req.expert_parallel}")


def plan(req: PlanRequest) -> Plan:
    """The layout using the fewest devices that fits, or the fixed sizes asked for; raises
    ValueError with every reason when nothing fits."""
    validate_request(req)
    c = req.config
    pipes = [req.pipeline] if req.pipeline else range(1, c.num_layers + 1)
    eps = [req.expert_parallel] if req.expert_parallel else _divisor_like(c.num_experts)
    best: Plan | None = None
    last_reasons: list[str] = []
    for p in pipes:
        for e in eps:
            candidate = build_plan(req, p, e)
            reasons = problems(candidate)
            if reasons:
                last_reasons = reasons
                continue
            if best is None or candidate.num_devices < best.num_devices:
                best = candidate
            break  # more shards at this pipeline size only adds devices
    if best is None:
        fixed = req.pipeline is not None or req.expert_parallel is not None
        head = "this layout does not fit" if fixed else "no layout fits"
        raise ValueError(f"{head}: " + "; ".join(last_reasons[:4]) + (" ..." if len(last_reasons) > 4 else ""))
    return best


def _divisor_like(n: int) -> list[int]:
    """Expert-parallel sizes to try: 1, 2, 4, ... up to n, plus n's divisors."""
    sizes = {2**i for i in range(int(math.log2(n)) + 1)} | {d for d in range(1, n + 1) if n % d == 0}
    return sorted(s for s in sizes if s <= n)
