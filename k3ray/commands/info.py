"""`k3ray info`: parameter counts and one sequence's cache memory, on the meta device."""

from __future__ import annotations

import argparse
import json
import sys

from k3ray.cli_flags import add_deprecated_alias
from k3ray.model_names import CONFIG, set_model_kind
from k3ray.model_source import MODEL_CONFIG_HELP, model_config

HELP = "parameter counts and per-sequence memory of a preset or checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_config_arguments(p)
    p.add_argument("--context-len", type=_parse_len, default=None, help="tokens (k/m suffixes; default: the model max)")
    add_format_argument(p)


def add_model_config_arguments(p: argparse.ArgumentParser, default: str = "k3") -> None:
    """`--model` read for its config only, and its old spellings (`--preset`, a positional path)."""
    p.add_argument("--model", default=default, help=MODEL_CONFIG_HELP)
    add_deprecated_alias(p, "--preset", "--model", dest="model")
    p.add_argument("legacy_path", nargs="?", help=argparse.SUPPRESS)  # the old positional path
    set_model_kind(p, CONFIG)


def add_format_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("table", "json"), default="table", help="print a table or JSON")


def model_argument(args: argparse.Namespace) -> str:
    """--model, or the deprecated positional path when one was given."""
    if args.legacy_path is None:
        return args.model
    print("warning: a positional checkpoint path is deprecated; use --model PATH", file=sys.stderr)
    return args.legacy_path


def _parse_len(text: str) -> int:
    t = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from e


def main(args: argparse.Namespace) -> int:
    from k3ray.info import sequence_memory, summarize  # lazy: torch stays out of CLI startup (`k3ray --help`)

    config = model_config(model_argument(args))
    s = summarize(config)
    ctx = args.context_len if args.context_len is not None else config.max_position_embeddings
    mem = sequence_memory(config, ctx)
    report = {
        "model": config.name,
        "layers": {"total": config.num_layers, "kda": len(config.kda_layer_ids), "mla": len(config.mla_layer_ids)},
        "total_params": s.total,
        "active_params": s.active,
        "params_by_type": s.params,
        "params_per_layer": s.per_layer,
        "weight_bytes": s.weight_bytes,
        "expert_format": config.expert_format,
        "sequence_memory": {
            "context_len": ctx,
            "kda_state_bytes": mem.kda_state_bytes,
            "conv_state_bytes": mem.conv_state_bytes,
            "mla_bytes_per_token": mem.mla_bytes_per_token,
            "mla_bytes": mem.mla_bytes,
            "total_bytes": mem.total_bytes,
        },
    }
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    print(f"{config.name}: {config.num_layers} layers ({len(config.kda_layer_ids)} KDA, {len(config.mla_layer_ids)} MLA), "
          f"{config.expert_format} experts")
    print(f"  total parameters   {_count(s.total)}   ({s.total:,})")
    print(f"  active per token   {_count(s.active)}   ({s.active:,})")
    print(f"  weights on disk    {_bytes(s.weight_bytes)}")
    for cat, n in s.params.items():
        print(f"    {cat:<20} {_count(n):>10}")
    for lt, n in s.per_layer.items():
        print(f"  one {lt} layer{'' if lt != 'routed_experts' else ' (routed experts)'}: {_count(n)}")
    print(f"  one sequence at {ctx:,} tokens:")
    print(f"    KDA state {_bytes(mem.kda_state_bytes)} + conv state {_bytes(mem.conv_state_bytes)} (constant)")
    print(f"    MLA latent {mem.mla_bytes_per_token:,} B/token -> {_bytes(mem.mla_bytes)}")
    print(f"    total {_bytes(mem.total_bytes)}")
    return 0


def _count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.4g}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n} B"
