"""`k3ray bench <name>`: each benchmark module exposes add_arguments(parser) and run(args) -> dict."""

from __future__ import annotations

import argparse
import importlib

from k3ray.bench.common import print_table, write_json

BENCHMARKS = {
    "model": ("k3ray.bench.model", "tiny K3 model prefill / decode tokens/s on this machine"),
    "kernels": ("k3ray.bench.kernels", "per-op kernel timings at K3 and tiny shapes"),
    "cluster": ("k3ray.actors.bench_cluster", "decode local vs Ray actors, pipeline hop and MoE dispatch cost"),
    "engine": ("k3ray.bench.engine", "continuous batching, prefix caching, speculative decoding, long prompts"),
    "serve": ("k3ray.evals.serve_bench.cli", "served TTFT / TPOT / ITL / throughput vs the in-process engine"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", metavar="PATH", help="also write the result object to PATH")
        p.set_defaults(_bench_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            p.set_defaults(_missing=True)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "_missing", False):
        raise ValueError(f"benchmark {args.bench!r} is not available in this build")
    result = importlib.import_module(args._bench_module).run(args)
    print_table(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
