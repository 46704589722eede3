"""`k3ray bench layer`: one decoder layer of each kind at a preset's widths, random weights and
MXFP4 experts, timed alone: prefill tokens/s, and decode step time at several batch sizes over a
filled context, with the bytes each step must move and the fraction of the HBM roofline reached.

kinds: kda_dense (layer 0: KDA + dense MLP), kda_moe (KDA + LatentMoE), mla_moe (MLA + LatentMoE);
the MoE layers are taken at mid depth, so the AttnRes bank they read is a typical one.
Bytes per step = the layer's weights (routed experts: the expected share a step's tokens touch) +
its cache traffic (KDA state read and written, MLA latents read) + the activation rows it reads.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from k3ray.bench.common import machine, median_time, under_torch
from k3ray.bench.kernels import H200_BYTES_PER_S
from k3ray.cli_flags import add_deprecated_alias
from k3ray.config import ModelConfig
from k3ray.device_flags import add_device_argument, add_dtype_argument
from k3ray.model_names import CONFIG, set_model_kind
from k3ray.model_source import MODEL_CONFIG_HELP, model_config
from k3ray.threads import add_threads_argument, set_threads

HELP = "one full-width decoder layer of each kind: prefill tok/s, decode step time, HBM roofline"
KINDS = ("kda_dense", "kda_moe", "mla_moe")
BLOCK = 64
# (prefill tokens, decode batches, decode context) per preset: K3's serving shapes, and a tiny
# size a CPU test runs in seconds
SIZES = {"k3": (8192, [1, 64, 256], 32768), "k3-tiny": (256, [1, 8], 512)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device_argument(p)
    p.add_argument("--model", default=None,
                   help=f"whose widths: {MODEL_CONFIG_HELP} (default: k3 on CUDA, k3-tiny on CPU)")
    add_deprecated_alias(p, "--preset", "--model", dest="model")
    set_model_kind(p, CONFIG)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="layer kinds to time (default all)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prefill tokens (default: 8,192 for k3, 256 for other models)")
    add_deprecated_alias(p, "--prefill-tokens", "--prompt-tokens", dest="prompt_tokens", type=int)
    p.add_argument("--decode-batch", type=int, nargs="+", default=None,
                   help="decode batch sizes (default: 1 64 256 for k3, 1 8 for other models)")
    p.add_argument("--context-len", type=int, default=None,
                   help="tokens in context of each decode step (default: 32,768 for k3, 512 for other models)")
    add_deprecated_alias(p, "--context", "--context-len", dest="context_len", type=int)
    add_dtype_argument(p, default="bfloat16")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    add_threads_argument(p)


def layer_index(config: ModelConfig, kind: str) -> int:
    """The layer benchmarked for `kind`: layer 0 for kda_dense, else the layer of that attention
    type with MoE nearest mid depth."""
    if kind == "kda_dense":
        if config.is_moe_layer(0) or config.layer_types[0] != "kda":
            raise ValueError(f"{config.name}: layer 0 is not KDA + dense MLP")
        return 0
    attention = kind.split("_")[0]
    found = [i for i, t in enumerate(config.layer_types) if t == attention and config.is_moe_layer(i)]
    if not found:
        raise ValueError(f"{config.name} has no {attention.upper()} + MoE layer")
    return min(found, key=lambda i: abs(i - config.num_layers // 2))


def bank_size(config: ModelConfig, layer_idx: int) -> int:
    """Finished AttnRes blocks in the bank that layer `layer_idx` receives."""
    return sum(config.is_block_boundary(j) for j in range(layer_idx))


@under_torch("no_grad")
def random_layer(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> DecoderLayer:
    """The decoder layer, built on `device`: dense weights as the tiny models draw them, routed
    experts as random MXFP4 bytes with a scale that gives them the same spread (quantising 896
    random experts would take minutes)."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch
    from torch import nn

    from k3ray.models.init import init_random_weights
    from k3ray.models.k3 import DecoderLayer, local_experts

    with torch.device(device):
        layer = DecoderLayer(config, layer_idx, dtype, local_experts(config, dtype, (0, config.num_experts)))
    moe = getattr(layer, "block_sparse_moe", None)
    experts = moe.experts if moe is not None else None
    if moe is not None:
        moe.experts = None  # drawn below, not quantised
    holder = nn.Module()
    holder.config, holder.layer = config, layer
    init_random_weights(holder, seed)
    if experts is not None:
        _random_mxfp4(experts, seed)
        moe.experts = experts
    return layer.eval()


def _random_mxfp4(experts: LocalExperts, seed: int) -> None:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.models.moe import PROJECTIONS

    assert experts.fmt == "mxfp4", "the benchmark's experts are MXFP4"
    gen = torch.Generator(experts.w1_packed.device).manual_seed(seed)
    for name in PROJECTIONS:
        packed, scale = experts.weights(name)
        fan_in = packed.shape[-1] * 2
        packed.random_(0, 256, generator=gen)
        scale.fill_(127 + round(math.log2(1 / (math.sqrt(fan_in) * _e2m1_rms()))))  # E8M0: 2^(s - 127)


def _weight_bytes(layer: DecoderLayer, config: ModelConfig, tokens: int) -> int:
    """Dense weights, plus the routed experts' bytes times the expected share of experts that
    `tokens` tokens touch (top-k of E each, uniformly)."""
    def nbytes(module: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))

    moe = getattr(layer, "block_sparse_moe", None)
    if moe is None:
        return nbytes(layer)
    routed = nbytes(moe.experts)
    dense = nbytes(layer) - routed
    touched = 1 - (1 - config.num_experts_per_token / config.num_experts) ** tokens
    return dense + int(routed * touched)


def _cache_bytes(cache: ModelCache, layer_idx: int, batch: int, tokens: int, context: int) -> int:
    """KDA: every sequence's state and conv window read and written; MLA: the context's latents
    read and the new ones written."""
    if layer_idx in cache.kda_state:
        per_seq = sum(pool[0].numel() * pool.element_size()
                      for pool in (cache.kda_state[layer_idx], cache.conv_state[layer_idx]))
        return 2 * batch * per_seq
    latent = cache.mla_latent[layer_idx]
    return (batch * context + tokens) * latent.shape[1] * latent.element_size()


def _step_inputs(config: ModelConfig, layer_idx: int, tokens: int, dtype, device, gen):
    """(prefix [T, D], bank: the finished blocks [T, D] each) as the layer receives them."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    D = config.hidden_size
    rows = [torch.randn(tokens, D, generator=gen, device=device).to(dtype)
            for _ in range(bank_size(config, layer_idx) + 1)]
    return rows[-1], rows[:-1]


def _cache(config: ModelConfig, layer_idx: int, seqs: int, context: int, dtype, device, gen) -> tuple:
    """A cache for `seqs` sequences of `context` tokens over this one layer, its states and latents
    random (a decode step reads a full context; a prefill overwrites it), and their block tables."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.models.forward_batch import ForwardBatch, ModelCache

    blocks_per_seq = -(-context // BLOCK)
    cache = ModelCache.allocate(config, seqs, seqs * blocks_per_seq, BLOCK, dtype=dtype, device=device,
                                layers=range(layer_idx, layer_idx + 1))
    for pool in (*cache.kda_state.values(), *cache.conv_state.values(), *cache.mla_latent.values()):
        pool.copy_(torch.randn(pool.shape, generator=gen, device=device) * 0.1)
    tables = torch.arange(seqs * blocks_per_seq, device=device).view(seqs, blocks_per_seq)
    return cache, tables


def _time(layer: DecoderLayer, prefix, bank, batch: ForwardBatch, device: torch.device, repeats: int) -> float:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    def step() -> None:
        layer(prefix, bank, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return median_time(step, repeats=repeats, warmup=1)


def _row(kind: str, phase: str, batch: int, context: int, tokens: int, seconds: float, nbytes: int,
         device: torch.device) -> dict[str, Any]:
    return {"kind": kind, "phase": phase, "batch": batch, "context": context, "tokens": tokens,
            "ms": seconds * 1e3, "tok_s": tokens / seconds, "bytes": nbytes,
            "roofline_frac": nbytes / H200_BYTES_PER_S / seconds if device.type == "cuda" else None}


@under_torch("inference_mode")
def bench_kind(config: ModelConfig, kind: str, dtype, device: torch.device, prefill_tokens: int,
               decode_batches: list[int], context: int, repeats: int) -> list[dict[str, Any]]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.models.forward_batch import ForwardBatch, ModelCache

    i = layer_index(config, kind)
    layer = random_layer(config, i, dtype, device)
    gen = torch.Generator(device).manual_seed(1)
    rows = []
    T = prefill_tokens
    cache, tables = _cache(config, i, 1, T, dtype, device, gen)
    prefix, bank = _step_inputs(config, i, T, dtype, device, gen)
    batch = ForwardBatch(torch.tensor([0, T], device=device), torch.tensor([T], device=device),
                         torch.zeros(1, dtype=torch.long, device=device), tables, cache)
    seconds = _time(layer, prefix, bank, batch, device, repeats)
    moved = _weight_bytes(layer, config, T) + _cache_bytes(cache, i, 1, T, 0) \
        + (len(bank) + 2) * prefix.numel() * prefix.element_size()
    rows.append(_row(kind, "prefill", 1, T, T, seconds, moved, device))
    del cache, tables, prefix, bank, batch
    for n in decode_batches:
        cache, tables = _cache(config, i, n, context, dtype, device, gen)
        prefix, bank = _step_inputs(config, i, n, dtype, device, gen)
        batch = ForwardBatch(torch.arange(n + 1, device=device), torch.full((n,), context, device=device),
                             torch.arange(n, device=device), tables, cache)
        seconds = _time(layer, prefix, bank, batch, device, repeats)
        moved = _weight_bytes(layer, config, n) + _cache_bytes(cache, i, n, n, context) \
            + (len(bank) + 2) * prefix.numel() * prefix.element_size()
        rows.append(_row(kind, "decode", n, context, n, seconds, moved, device))
        del cache, tables, prefix, bank, batch
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.device import resolve_device

    device = resolve_device(args.device)
    config = model_config(args.model or ("k3" if device.type == "cuda" else "k3-tiny"))
    name = config.name
    prefill, batches, context = SIZES.get(name, SIZES["k3-tiny"])
    prefill = args.prompt_tokens or prefill
    batches = args.decode_batch or batches
    context = args.context_len or context
    if min([prefill, context, *batches]) < 1:
        raise ValueError("--prompt-tokens, --decode-batch and --context-len must be >= 1")
    set_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    for kind in args.kinds:  # one layer and its caches alive at a time
        rows += bench_kind(config, kind, dtype, device, prefill, batches, context, args.repeats)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "layers": rows,
        "machine": machine(),
        "config": {"preset": name, "device": str(device), "dtype": args.dtype, "kinds": args.kinds,
                   "layer_index": {k: layer_index(config, k) for k in args.kinds},
                   "prefill_tokens": prefill, "decode_batch": batches, "context": context,
                   "repeats": args.repeats, "hbm_bytes_per_s": H200_BYTES_PER_S,
                   "threads": torch.get_num_threads()},
    }


def _e2m1_rms() -> float:
    """RMS of uniformly random E2M1 codes."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.kernels.moe.mxfp4 import E2M1_VALUES

    return math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
