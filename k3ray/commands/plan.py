"""`k3ray plan`: size a K3 deployment (stage / expert-shard / router actors) for a device type.

Each actor's memory in GiB: weights_gib + kda_state_gib + mla_cache_gib + activations_gib (the
reserve of a stage or replica for one chunked-prefill step's activations) + replicas_gib (an
expert shard's replicas of hot experts) = total_gib, each rounded to 0.01."""

from __future__ import annotations

import argparse
import dataclasses
import json

from k3ray.capacity import GIB, PlanRequest, latent_bytes_per_token, layer_costs_mismatch, plan, predict_throughput
from k3ray.cli_flags import add_deprecated_alias
from k3ray.commands.info import _parse_len, add_format_argument, add_model_config_arguments, model_argument
from k3ray.config import PRESETS
from k3ray.model_source import model_config

HELP = "size a deployment: actor layout, devices and memory per actor"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_config_arguments(p)
    p.add_argument("--device-type", default="H200", help="H100, H200, B200 or CPU")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory per device (default: the device type's; required for CPU)")
    p.add_argument("--context-len", type=_parse_len, default=131072, help="tokens per sequence (k/m suffixes)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences resident at once (serve's --max-num-seqs)")
    p.add_argument("--expert-format", choices=["mxfp4", "bf16"], default="mxfp4", help="routed-expert weight format")
    add_deprecated_alias(p, "--experts", "--expert-format", dest="expert_format", choices=["mxfp4", "bf16"])
    p.add_argument("--pipeline", type=int, default=None, help="fix the number of pipeline stages (default: the fewest "
                   "that fit)")
    p.add_argument("--expert-parallel", type=int, default=None, help="fix expert shards per stage (default: the fewest "
                   "that fit)")
    p.add_argument("--redundant-experts", type=int, default=1,
                   help="replicas of hot experts per expert shard and MoE layer (expert balancing)")
    p.add_argument("--layer-costs", metavar="FILE", default=None,
                   help="`k3ray bench layer --json` output: also predict tokens/s per device for the layout "
                   "(default: no prediction); refused when measured for another model or device type")
    p.add_argument("--extrapolate", action="store_true",
                   help="print that prediction from another model's or device's costs, labelled an extrapolation")
    add_format_argument(p)


def main(args: argparse.Namespace) -> int:
    req = PlanRequest(
        config=model_config(model_argument(args)),
        device=args.device_type.upper() if args.device_type.lower() != "cpu" else "CPU",
        context_len=args.context_len, concurrency=args.max_num_seqs, expert_format=args.expert_format,
        pipeline=args.pipeline, expert_parallel=args.expert_parallel, device_memory_gib=args.device_memory_gib,
        redundant_experts=args.redundant_experts,
    )
    p = plan(req)
    rows = [
        {"role": a.role, "stage": a.stage, "layers": f"{a.layers[0]}-{a.layers[1] - 1}" if a.layers[1] else "",
         "experts": f"{a.experts[0]}-{a.experts[1] - 1}" if a.experts else "", "devices": a.devices,
         "weights_gib": round(a.weight_bytes / GIB, 2), "kda_state_gib": round(a.kda_state_bytes / GIB, 2),
         "mla_cache_gib": round(a.mla_cache_bytes / GIB, 2), "activations_gib": round(a.other_bytes / GIB, 2),
         "replicas_gib": round(a.replica_bytes / GIB, 2),
         "total_gib": round(a.total_bytes / GIB, 2)}
        for a in p.actors
    ]
    summary = {"model": req.config.name, "device": req.device, "pipeline": p.pipeline,
               "expert_parallel": p.expert_parallel, "devices": p.num_devices,
               "usable_gib_per_device": round(p.device_bytes / GIB, 1), "context_len": req.context_len,
               "concurrency": req.concurrency, "experts": req.expert_format,
               "serve_parallel": p.serve_parallel(), "actors": rows}
    prediction, caveat = _prediction(p, args.layer_costs, args.extrapolate) if args.layer_costs else (None, None)
    if prediction is not None:
        summary["prediction"] = {k: round(v, 3) if isinstance(v, float) else v
                                 for k, v in dataclasses.asdict(prediction).items()}
        summary["prediction"]["extrapolated_from"] = caveat
    if args.format == "json":
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{req.config.name} on {req.device}: pipeline {p.pipeline} x expert-parallel {p.expert_parallel} "
          f"= {p.num_devices} devices ({summary['usable_gib_per_device']} GiB usable each), "
          f"{req.concurrency} x {req.context_len:,}-token sequences, {req.expert_format} experts")
    widths = {c: max(13, len(c)) for c in rows[0]}
    print("  " + "  ".join(f"{c:>{w}}" for c, w in widths.items()))
    for r in rows:
        print("  " + "  ".join(f"{str(r[c]):>{w}}" for c, w in widths.items()))
    print(f"  k3ray serve {p.serve_flags()}")
    if prediction is not None:
        scaled = (f"MLA decode costs measured at a {prediction.measured_context:,}-token context, scaled to "
                  f"{prediction.context_len:,}" if prediction.measured_context != prediction.context_len else
                  f"decode costs at a {prediction.context_len:,}-token context")
        head = f"EXTRAPOLATION from costs measured for {caveat}" if caveat else "predicted"
        print(f"{head} from {args.layer_costs} ({scaled}): "
              f"decode {prediction.decode_tok_s_per_device:,.1f} tok/s per device "
              f"({prediction.decode_tok_s:,.1f} per replica, {prediction.decode_step_ms:,.1f} ms a step of "
              f"{prediction.batch}), prefill {prediction.prefill_tok_s_per_device:,.1f} tok/s per device")
    return 0


def _prediction(p, path: str, extrapolate: bool):
    """(the throughput predicted from a `k3ray bench layer --json` file, None or what it was measured
    for when that is not the plan's model and device type: then only with --extrapolate)."""

    with open(path) as f:
        data = json.load(f)
    rows = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: no `layers` list (write it with `k3ray bench layer --json {path}`)")
    keys = {"kind", "phase", "batch", "context", "tokens", "ms", "bytes"}
    for row in rows:
        if not isinstance(row, dict) or not keys <= row.keys():
            raise ValueError(f"{path}: every `layers` row needs {sorted(keys)}, got {row!r}")
    measured = data.get("config") or {}
    model, device, gpu = measured.get("preset"), measured.get("device"), (data.get("machine") or {}).get("gpu")
    mismatch = layer_costs_mismatch(p, model, device, gpu)
    if mismatch and not extrapolate:
        name, kind = p.request.config.name, p.request.device
        where = "--device cpu" if kind == "CPU" else f"--device cuda` on a {kind}"
        raise ValueError(f"{path} was measured for {'; '.join(mismatch)}: measure this plan's costs with "
                         f"`k3ray bench layer --model {name} {where}{'`' if kind == 'CPU' else ''}, or pass "
                         "--extrapolate to print the figure labelled as an extrapolation")
    measured_config = model_config(model) if model in PRESETS else p.request.config
    latent = latent_bytes_per_token(measured_config, 4 if measured.get("dtype") == "float32" else 2)
    caveat = f"{model or 'an unknown model'} on {gpu or device or 'an unknown device'}" if mismatch else None
    return predict_throughput(p, rows, latent), caveat
