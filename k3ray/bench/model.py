"""`k3ray bench model`: tiny K3 prefill and decode tokens/s in one process (fp32 and bf16), on
`--device`; on CUDA also decode replayed from captured CUDA graphs (phase decode_graph)."""

from __future__ import annotations

import argparse
import statistics
import time

from k3ray.bench.common import machine, median_time
from k3ray.cli_flags import add_deprecated_alias
from k3ray.device_flags import add_device_argument, add_enforce_eager_argument
from k3ray.model_source import add_random_model_argument, model_config
from k3ray.threads import add_threads_argument, set_threads

HELP = "tiny K3 model prefill / decode tokens/s on this machine"
BLOCK = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_random_model_argument(p)
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prefill tokens")
    add_deprecated_alias(p, "--prompt-len", "--prompt-tokens", dest="prompt_tokens", type=int)
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 16], help="decode batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    add_threads_argument(p)
    add_device_argument(p)
    add_enforce_eager_argument(p)


def _sync(device: torch.device) -> None:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill(model, ids: torch.Tensor, n_seqs: int, device: torch.device,
             room: int = 256) -> tuple[ModelCache, torch.Tensor]:
    """n_seqs copies of ids prefilled into a fresh cache with room for `room` more tokens each."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.models.forward_batch import ForwardBatch, ModelCache

    c = model.config
    T = ids.numel()
    blocks_per_seq = (T + room) // BLOCK + 1
    cache = ModelCache.allocate(c, n_seqs, n_seqs * blocks_per_seq, BLOCK, dtype=model.dtype, device=device)
    tables = torch.arange(n_seqs * blocks_per_seq).view(n_seqs, blocks_per_seq)
    cu = torch.arange(n_seqs + 1) * T
    batch = ForwardBatch(cu, torch.full((n_seqs,), T), torch.arange(n_seqs), tables, cache)
    with torch.no_grad():
        model(ids.repeat(n_seqs).to(device), batch, logits_indices=(cu[1:] - 1).to(device))
    _sync(device)
    return cache, tables


def _decode_eager(model, ids: torch.Tensor, bsz: int, steps: int, device: torch.device) -> None:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.models.forward_batch import ForwardBatch, ModelCache

    cache, tables = _prefill(model, ids, bsz, device)
    tok = torch.randint(0, 256, (bsz,)).to(device)
    with torch.no_grad():
        for step in range(steps):
            ctx = torch.full((bsz,), ids.numel() + 1 + step)
            b = ForwardBatch(torch.arange(bsz + 1), ctx, torch.arange(bsz), tables, cache)
            tok = model(tok, b).argmax(-1)
    _sync(device)


def graph_decode_seconds(model, ids: torch.Tensor, bsz: int, steps: int, device: torch.device) -> float:
    """Seconds for `steps` decode steps of bsz copies of ids replayed from a captured CUDA graph
    (prefill and capture not counted)."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.engine.execution.cuda_graphs import DecodeGraphs
    from k3ray.engine.execution.plan import BatchPlan

    cache, tables = _prefill(model, ids, bsz, device, room=max(256, steps + 1))
    graphs = DecodeGraphs(model, cache, bsz, tables.shape[1])
    tok = torch.randint(0, 256, (bsz,))
    plans = [BatchPlan(tok, torch.arange(bsz + 1), torch.full((bsz,), ids.numel() + 1 + step), torch.arange(bsz),
                       tables, torch.arange(bsz)) for step in range(steps)]
    t0 = time.perf_counter()
    for plan in plans:
        graphs.run(plan)
    _sync(device)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    from k3ray.device import resolve_device
    from k3ray.models.init import build_model

    config = model_config(args.model)
    device = resolve_device(args.device)
    set_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(config, dtype, seed=0, device=device)
        name = str(dtype).split(".")[-1]
        ids = torch.randint(0, 256, (args.prompt_tokens,))
        t = median_time(lambda: _prefill(model, ids, 1, device), repeats=args.repeats)
        rows.append({"phase": "prefill", "dtype": name, "batch": 1, "tokens": args.prompt_tokens,
                     "tok_s": args.prompt_tokens / t})
        for bsz in args.decode_batch:
            prefill_part = median_time(lambda: _prefill(model, ids[:16], bsz, device), repeats=args.repeats)
            t = median_time(lambda: _decode_eager(model, ids[:16], bsz, args.decode_steps, device),
                            repeats=args.repeats) - prefill_part
            tokens = bsz * args.decode_steps
            rows.append({"phase": "decode", "dtype": name, "batch": bsz, "tokens": tokens, "tok_s": tokens / t})
            if device.type == "cuda" and not args.enforce_eager:
                t = statistics.median(graph_decode_seconds(model, ids[:16], bsz, args.decode_steps, device)
                                      for _ in range(args.repeats))
                rows.append({"phase": "decode_graph", "dtype": name, "batch": bsz, "tokens": tokens,
                             "tok_s": tokens / t})
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    return {
        "prefill_tok_s": next(r["tok_s"] for r in fp32 if r["phase"] == "prefill"),
        "decode_tok_s": next(r["tok_s"] for r in fp32 if r["phase"] == "decode" and r["batch"] == 1),
        "rows": rows,
        "machine": machine(),
        "config": {"preset": config.name, "prompt_len": args.prompt_tokens, "decode_steps": args.decode_steps,
                   "decode_batch": args.decode_batch, "repeats": args.repeats, "threads": torch.get_num_threads(),
                   "device": str(device), "cuda_graphs": device.type == "cuda" and not args.enforce_eager},
    }
