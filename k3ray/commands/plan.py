"""`k3ray plan`: size a K3 deployment (stage / expert-shard / router actors) for a device type."""

from __future__ import annotations

import argparse
import dataclasses
import json

from k3ray.capacity import GIB, PlanRequest, plan, predict_throughput
from k3ray.commands.info import _parse_len, load_config

HELP = "size a deployment: actor layout, devices and memory per actor"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a named config: k3 (default) or k3-tiny")
    src.add_argument("path", nargs="?", help="a checkpoint directory or a config.json")
    p.add_argument("--device", default="H200", help="H100, H200, B200 or CPU")
    p.add_argument("--device-memory-gib", type=float, default=None, help="memory per device (required for CPU)")
    p.add_argument("--context-len", type=_parse_len, default=131072, help="tokens per sequence (k/m suffixes)")
    p.add_argument("--concurrency", type=int, default=8, help="sequences resident at once")
    p.add_argument("--experts", choices=["mxfp4", "bf16"], default="mxfp4", help="routed-expert weight format")
    p.add_argument("--pipeline", type=int, default=None, help="fix the number of pipeline stages")
    p.add_argument("--expert-parallel", type=int, default=None, help="fix expert shards per stage")
    p.add_argument("--redundant-experts", type=int, default=1,
                   help="replicas of hot experts per expert shard and MoE layer (expert balancing)")
    p.add_argument("--layer-costs", metavar="FILE", default=None,
                   help="`k3ray bench layer --json` output: also predict tokens/s per device for the layout")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    req = PlanRequest(
        config=load_config(args.preset, args.path), device=args.device.upper() if args.device.lower() != "cpu" else "CPU",
        context_len=args.context_len, concurrency=args.concurrency, expert_format=args.experts,
        pipeline=args.pipeline, expert_parallel=args.expert_parallel, device_memory_gib=args.device_memory_gib,
        redundant_experts=args.redundant_experts,
    )
    p = plan(req)
    rows = [
        {"role": a.role, "stage": a.stage, "layers": f"{a.layers[0]}-{a.layers[1] - 1}" if a.layers[1] else "",
         "experts": f"{a.experts[0]}-{a.experts[1] - 1}" if a.experts else "", "devices": a.devices,
         "weights_gib": round(a.weight_bytes / GIB, 2), "kda_state_gib": round(a.kda_state_bytes / GIB, 2),
         "mla_cache_gib": round(a.mla_cache_bytes / GIB, 2), "replicas_gib": round(a.replica_bytes / GIB, 2),
         "total_gib": round(a.total_bytes / GIB, 2)}
        for a in p.actors
    ]
    summary = {"model": req.config.name, "device": req.device, "pipeline": p.pipeline,
               "expert_parallel": p.expert_parallel, "devices": p.num_devices,
               "usable_gib_per_device": round(p.device_bytes / GIB, 1), "context_len": req.context_len,
               "concurrency": req.concurrency, "experts": req.expert_format,
               "serve_parallel": p.serve_parallel(), "actors": rows}
    prediction = predict_throughput(p, _layer_rows(args.layer_costs)) if args.layer_costs else None
    if prediction is not None:
        summary["prediction"] = {k: round(v, 3) if isinstance(v, float) else v
                                 for k, v in dataclasses.asdict(prediction).items()}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{req.config.name} on {req.device}: pipeline {p.pipeline} x expert-parallel {p.expert_parallel} "
          f"= {p.num_devices} devices ({summary['usable_gib_per_device']} GiB usable each), "
          f"{req.concurrency} x {req.context_len:,}-token sequences, {req.expert_format} experts")
    cols = list(rows[0])
    print("  " + "  ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print("  " + "  ".join(f"{str(r[c]):>13}" for c in cols))
    print(f"  k3ray serve {p.serve_flags()}")
    if prediction is not None:
        print(f"predicted from {args.layer_costs} (decode costs at a {prediction.measured_context:,}-token context): "
              f"decode {prediction.decode_tok_s_per_device:,.1f} tok/s per device "
              f"({prediction.decode_tok_s:,.1f} per replica, {prediction.decode_step_ms:,.1f} ms a step of "
              f"{prediction.batch}), prefill {prediction.prefill_tok_s_per_device:,.1f} tok/s per device")
    return 0


def _layer_rows(path: str) -> list[dict]:
    """The `layers` rows of a `k3ray bench layer --json` file."""
    with open(path) as f:
        data = json.load(f)
    rows = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: no `layers` list (write it with `k3ray bench layer --json {path}`)")
    keys = {"kind", "phase", "batch", "context", "tokens", "ms"}
    for row in rows:
        if not isinstance(row, dict) or not keys <= row.keys():
            raise ValueError(f"{path}: every `layers` row needs {sorted(keys)}, got {row!r}")
    return rows
