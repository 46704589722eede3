"""Capacity planner: split a K3 config into pipeline-stage and expert-shard actors that fit a
device, with the memory of every actor (weights, KDA state, MLA cache, the activation reserve of a
stage, an expert shard's replicas of hot experts), or say why it cannot.

Each stage actor holds contiguous layers (all their non-expert weights and caches; the first
also the embedding, the last the head); each of a stage's `expert_parallel` shard actors holds
an equal slice of that stage's routed experts (with expert parallelism also `redundant_experts`
replicas of hot experts per MoE layer, placed by the router); one CPU-only router actor per stage
with MoE layers, and a CPU-side vision encoder for a config with a vision tower: the actors `k3ray serve`
asks Ray for (Plan.serve_parallel). With measured layer costs (`k3ray bench layer`),
predict_throughput estimates a layout's tokens/s per device."""

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
    # with expert parallelism: replicas of hot experts per shard (each MoE layer of its stage), as
    # the MoE router places them (ParallelConfig.redundant_experts)
    redundant_experts: int = 1


@dataclass(frozen=True)
class ActorPlan:
    role: str  # "stage" | "expert_shard" | "router" | "vision", or "replica" (pipeline 1 x expert-parallel 1)
    stage: int
    layers: tuple[int, int]
    experts: tuple[int, int] | None
    weight_bytes: int
    kda_state_bytes: int
    mla_cache_bytes: int
    other_bytes: int  # a stage's (or replica's) activation reserve
    devices: int
    replica_bytes: int = 0  # an expert shard's replicas of hot experts (beside its own range's weights)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kda_state_bytes + self.mla_cache_bytes + self.other_bytes + self.replica_bytes


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

    def serve_parallel(self) -> dict[str, float | int]:
        """The `parallel` settings of `k3ray serve` that ask Ray for exactly this layout's actors:
        one device per stage and per expert shard (GPUs, or none on a CPU plan)."""
        gpus = 0.0 if self.request.device == "CPU" else 1.0
        if self.pipeline == self.expert_parallel == 1:  # one undistributed model in the replica
            return {"pipeline": 1, "expert_parallel": 1, "replica_gpus": gpus}
        return {"pipeline": self.pipeline, "expert_parallel": self.expert_parallel,
                "stage_gpus": gpus, "shard_gpus": gpus}

    def serve_flags(self) -> str:
        return " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in self.serve_parallel().items())


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
        last = embed + 3 * 2 * c.hidden_size if b == c.num_layers else 0  # lm_head, norm, output AttnRes
        weights = sum(dense[a:b]) + (embed if a == 0 else 0) + last
        kda_state = req.concurrency * n_kda * (H * K * K * 4 + 3 * H * K * (W - 1) * 2)
        mla = req.concurrency * n_mla * req.context_len * c.mla_latent_dim * 2
        reserve = int(req.activation_reserve_gib * GIB)
        actors.append(ActorPlan("stage", s, (a, b), None, weights, kda_state, mla, reserve, 1))
        stage_experts = sum(routed[a:b])
        for e, (e0, e1) in enumerate(split_range(c.num_experts, expert_parallel)):
            share = stage_experts * (e1 - e0) // c.num_experts
            replicas = min(req.redundant_experts, c.num_experts - (e1 - e0)) if expert_parallel > 1 else 0
            if share:
                actors.append(ActorPlan("expert_shard", s, (a, b), (e0, e1), share, 0, 0, 0, 1,
                                        replicas * stage_experts // c.num_experts))
        if stage_experts:  # a stage without MoE layers gets no router (as k3ray serve places them)
            actors.append(ActorPlan("router", s, (a, b), None, 0, 0, 0, 0, 0))
    vision = _vision_bytes(c) if c.vision is not None else 0
    if pipeline == expert_parallel == 1:  # k3ray serve runs such a model whole in its replica
        stage, experts = actors[0], sum(a.weight_bytes for a in actors[1:])
        actors = [ActorPlan("replica", 0, stage.layers, (0, c.num_experts), stage.weight_bytes + experts + vision,
                            stage.kda_state_bytes, stage.mla_cache_bytes, stage.other_bytes, 1)]
    elif vision:  # serve's VisionEncoder actor, on CPU by default (--vision-gpus)
        actors.append(ActorPlan("vision", 0, (0, 0), None, vision, 0, 0, 0, 0))
    return Plan(req, pipeline, expert_parallel, tuple(actors), _device_bytes(req))


def _vision_bytes(c: ModelConfig) -> int:
    # lazy: torch only to size a vision tower on the meta device; `k3ray plan` otherwise stays torch-free
    import torch

    from k3ray.vision.model import K3VisionModel

    with torch.device("meta"):
        tower = K3VisionModel(c.vision, torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in tower.parameters())


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
            elif a.role == "replica":
                what = "the whole model in one replica"
            out.append(
                f"{what} needs {a.total_bytes / GIB:.1f} GiB (weights {a.weight_bytes / GIB:.1f}, KDA state "
                f"{a.kda_state_bytes / GIB:.1f}, MLA cache {a.mla_cache_bytes / GIB:.1f}, activations "
                f"{a.other_bytes / GIB:.1f}, expert replicas {a.replica_bytes / GIB:.1f}) > "
                f"{plan.device_bytes / GIB:.1f} GiB usable on one {plan.request.device}"
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
    if req.redundant_experts < 0:
        raise ValueError(f"redundant_experts must be >= 0, got {req.redundant_experts}")


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


@dataclass(frozen=True)
class ThroughputPrediction:
    """A layout's tokens/s from per-layer costs measured by `k3ray bench layer`: every step runs
    each layer once, stage after stage (k3ray does not overlap stages), each layer at its measured
    single-device time (expert parallelism's split of the experts and the hops between actors are
    not counted: a conservative estimate)."""

    batch: int  # sequences per decode step (the plan's concurrency)
    decode_step_ms: float  # one decode step through every layer
    decode_tok_s: float  # per replica
    decode_tok_s_per_device: float
    prefill_tok_s_per_device: float
    measured_context: int  # the context the decode costs were measured at
    context_len: int  # the plan's: MLA decode costs scaled to it by the latent bytes each step reads


def layer_kind(config: ModelConfig, layer_idx: int) -> str:
    """The `k3ray bench layer` kind of a layer: kda_dense, kda_moe or mla_moe."""
    return f"{config.layer_types[layer_idx]}_{'moe' if config.is_moe_layer(layer_idx) else 'dense'}"


def _interpolated_ms(points: list[tuple[int, float]], batch: int) -> float:
    """Decode ms at `batch` from measured (batch, ms): linear between neighbours; below the
    smallest batch its time, above the largest its time per sequence."""
    points = sorted(points)
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, m0), (b1, m1) in zip(points, points[1:]):
        if batch <= b1:
            return m0 + (m1 - m0) * (batch - b0) / (b1 - b0)
    b, m = points[-1]
    return m * batch / b


def layer_costs_mismatch(p: Plan, model: str | None, device: str | None, gpu: str | None) -> list[str]:
    """How costs measured for `model` on `device` (torch's: cpu, cuda:0; `gpu` its name) differ
    from the plan's model and device type; empty when they match."""
    problems = []
    if model != p.request.config.name:
        problems.append(f"model {model or 'unknown'}, not {p.request.config.name}")
    on_gpu = (device or "").startswith("cuda")
    if p.request.device == "CPU" and device != "cpu" or p.request.device != "CPU" and not (
            on_gpu and p.request.device in (gpu or "").upper()):
        problems.append(f"device {gpu if on_gpu and gpu else device or 'unknown'}, not {p.request.device}")
    return problems


def mla_decode_ms_at(row: dict, context_len: int, latent_bytes_per_token: int) -> float:
    """An MLA decode row's time at another context, scaled by the bytes its step moves (decode is
    memory bound: the row's `bytes` = weights + the context's latents + activations)."""
    extra = int(row["batch"]) * (context_len - int(row["context"])) * latent_bytes_per_token
    return float(row["ms"]) * (int(row["bytes"]) + extra) / int(row["bytes"])


def latent_bytes_per_token(config: ModelConfig, element_bytes: int = 2) -> int:
    """One token's MLA latent (compressed KV + rope key) in one layer's cache."""
    return (config.kv_lora_rank + config.qk_rope_head_dim) * element_bytes


def predict_throughput(p: Plan, layers: list[dict], latent_bytes: int | None = None) -> ThroughputPrediction:
    """layers: the `layers` rows of `k3ray bench layer` JSON ({kind, phase, batch, context, tokens,
    ms, bytes, ...}); MLA decode rows measured at another context are scaled to the plan's
    (`latent_bytes`: a token's latent in the measured layer, default the plan's model in bf16).
    Raises ValueError when a kind the model uses was not measured."""
    c = p.request.config
    latent_bytes = latent_bytes or latent_bytes_per_token(c)
    decode: dict[str, list[tuple[int, float]]] = {}
    prefill_s_per_token: dict[str, float] = {}
    contexts = set()
    for row in layers:
        if row["phase"] == "decode":
            rescale = row["kind"].startswith("mla") and int(row["context"]) != p.request.context_len
            ms = mla_decode_ms_at(row, p.request.context_len, latent_bytes) if rescale else float(row["ms"])
            decode.setdefault(row["kind"], []).append((int(row["batch"]), ms))
            contexts.add(int(row["context"]))
        elif row["phase"] == "prefill":
            prefill_s_per_token[row["kind"]] = float(row["ms"]) / 1e3 / int(row["tokens"])
    kinds = [layer_kind(c, i) for i in range(c.num_layers)]
    missing = sorted(set(kinds) - (decode.keys() & prefill_s_per_token.keys()))
    if missing:
        raise ValueError(f"the layer costs have no decode and prefill rows for {missing}")
    batch = p.request.concurrency
    step_ms = sum(_interpolated_ms(decode[k], batch) for k in kinds)
    decode_tok_s = batch / (step_ms / 1e3)
    prefill_tok_s = 1 / sum(prefill_s_per_token[k] for k in kinds)
    devices = max(p.num_devices, 1)
    return ThroughputPrediction(batch, step_ms, decode_tok_s, decode_tok_s / devices, prefill_tok_s / devices,
                                max(contexts), p.request.context_len)
