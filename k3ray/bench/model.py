"""`k3ray bench model`: tiny K3 prefill and decode tokens/s in one process (fp32 and bf16)."""

from __future__ import annotations

import argparse

import torch

from k3ray.bench.common import machine, median_time
from k3ray.config import preset
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.init import build_model

HELP = "tiny K3 model prefill / decode tokens/s on this machine"
BLOCK = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def _prefill(model, ids: torch.Tensor, n_seqs: int) -> tuple[ModelCache, torch.Tensor]:
    c = model.config
    T = ids.numel()
    blocks_per_seq = (T + 256) // BLOCK + 1
    cache = ModelCache.allocate(c, n_seqs, n_seqs * blocks_per_seq, BLOCK, dtype=model.dtype)
    tables = torch.arange(n_seqs * blocks_per_seq).view(n_seqs, blocks_per_seq)
    cu = torch.arange(n_seqs + 1) * T
    batch = ForwardBatch(cu, torch.full((n_seqs,), T), torch.arange(n_seqs), tables, cache)
    with torch.no_grad():
        model(ids.repeat(n_seqs), batch, logits_indices=cu[1:] - 1)
    return cache, tables


def run(args: argparse.Namespace) -> dict:
    config = preset(args.preset)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(config, dtype, seed=0)
        ids = torch.randint(0, 256, (args.prompt_len,))
        t = median_time(lambda: _prefill(model, ids, 1), repeats=args.repeats)
        rows.append({"phase": "prefill", "dtype": str(dtype).split(".")[-1], "batch": 1,
                     "tokens": args.prompt_len, "tok_s": args.prompt_len / t})
        for bsz in args.decode_batch:
            def decode() -> None:
                cache, tables = _prefill(model, ids[:16], bsz)
                tok = torch.randint(0, 256, (bsz,))
                with torch.no_grad():
                    for step in range(args.decode_steps):
                        b = ForwardBatch(torch.arange(bsz + 1), torch.full((bsz,), 17 + step), torch.arange(bsz), tables, cache)
                        tok = model(tok, b).argmax(-1)

            prefill_part = median_time(lambda: _prefill(model, ids[:16], bsz), repeats=args.repeats)
            t = median_time(decode, repeats=args.repeats) - prefill_part
            rows.append({"phase": "decode", "dtype": str(dtype).split(".")[-1], "batch": bsz,
                         "tokens": bsz * args.decode_steps, "tok_s": bsz * args.decode_steps / t})
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    return {
        "prefill_tok_s": next(r["tok_s"] for r in fp32 if r["phase"] == "prefill"),
        "decode_tok_s": next(r["tok_s"] for r in fp32 if r["phase"] == "decode" and r["batch"] == 1),
        "rows": rows,
        "machine": machine(),
        "config": {"preset": args.preset, "prompt_len": args.prompt_len, "decode_steps": args.decode_steps,
                   "decode_batch": args.decode_batch, "repeats": args.repeats, "threads": torch.get_num_threads()},
    }
