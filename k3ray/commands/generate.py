"""`k3ray generate`: single-process generation from a checkpoint (default: the tiny K3)."""

from __future__ import annotations

import argparse
import time

from k3ray.device_flags import add_device_argument, add_dtype_argument
from k3ray.threads import add_threads_argument, set_threads

HELP = "generate text in this process from a checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the tiny K3, made on first use)")
    p.add_argument("--prompt", default="The Ray cluster", help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the checkpoint's own)")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_dtype_argument(p)
    add_threads_argument(p)
    add_device_argument(p)


def main(args: argparse.Namespace) -> int:
    # lazy: torch and the model stay out of CLI startup (`k3ray --help`)
    import torch

    from k3ray.api import K3

    set_threads(args.threads)
    k3 = K3.load(args.model, dtype=getattr(torch, args.dtype), device=args.device, tokenizer=args.tokenizer)
    if k3.tokenizer is None:
        raise ValueError(f"{args.model} holds no tokenizer files; name a tokenizer directory with --tokenizer")
    prompt = args.prompt
    if args.chat:
        prompt = k3.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = k3.tokenizer.encode(prompt, allow_special=args.chat)
    t0 = time.perf_counter()
    out = k3.generate(ids, max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                      seed=args.seed)
    dt = time.perf_counter() - t0
    print(f"[{k3.name}: {len(ids)} prompt tokens -> {len(out)} new tokens in {dt:.2f}s]")
    print(prompt + k3.tokenizer.decode(out, skip_special_tokens=True))
    return 0
