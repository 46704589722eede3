"""`k3ray serve`: an OpenAI-compatible server for a K3 checkpoint on Ray Serve.

With no flags: a private local Ray instance, the tiny default model, http://127.0.0.1:8000,
until Ctrl-C (then Serve and Ray are shut down). The same app deploys with
`serve deploy cluster/serve-config.yaml`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

HELP = "serve a checkpoint with an OpenAI-compatible API on Ray Serve"
# ServeArgs fields set from flags of the same name (None = ServeArgs' default)
APP_FLAGS = (
    "model", "served_model_name", "dtype", "pipeline", "expert_parallel", "replica_cpus", "stage_cpus",
    "shard_cpus", "router_cpus", "stage_gpus", "shard_gpus", "replica_gpus", "vision_cpus", "vision_gpus",
    "allow_remote_media_urls", "max_media_bytes", "max_media_per_prompt", "media_fetch_timeout_s", "placement_strategy", "moe_dispatch", "torch_threads", "engine_process",
    "min_replicas", "max_replicas",
    "initial_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s", "metrics_interval_s",
    "look_back_period_s", "max_ongoing_requests", "max_queued_requests", "retry_after_s", "api_key",
    "max_body_bytes", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "cache_memory_mb",
    "enable_prefix_caching", "speculative_ngram", "seed",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    g.add_argument("--ingress", choices=["haproxy", "proxy"], default=None,
                   help="HTTP in front of the replicas of a local Ray instance: HAProxy, each replica streaming "
                   "from its own HTTP server (default), or Serve's proxy actor; a joined cluster keeps its own "
                   "(RAY_SERVE_ENABLE_HA_PROXY on its nodes)")
    g.add_argument("--num-cpus", type=float, default=None, help="CPUs of the local Ray instance (default: all)")
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (default: $K3RAY_API_KEY)")
    g.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 64 MiB)")
    g.add_argument("--served-model-name", default=None, help="model id clients send (default: checkpoint folder name)")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="checkpoint directory (default: the tiny K3, made on first use)")
    m.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    m.add_argument("--pipeline", type=int, default=None, help="pipeline stages per replica (>1: Ray actors)")
    m.add_argument("--expert-parallel", type=int, default=None, help="expert shards per stage (>1: Ray actors)")
    m.add_argument("--replica-cpus", type=float, default=None)
    m.add_argument("--stage-cpus", type=float, default=None)
    m.add_argument("--shard-cpus", type=float, default=None)
    m.add_argument("--router-cpus", type=float, default=None)
    m.add_argument("--stage-gpus", type=float, default=None, help="GPUs per pipeline-stage actor (0)")
    m.add_argument("--shard-gpus", type=float, default=None, help="GPUs per expert-shard actor (0)")
    m.add_argument("--replica-gpus", type=float, default=None, help="GPUs of an undistributed replica (0)")
    m.add_argument("--vision-cpus", type=float, default=None, help="CPUs of a pipeline's VisionEncoder actor")
    m.add_argument("--vision-gpus", type=float, default=None)
    m.add_argument("--allow-remote-media-urls", action="store_true", default=None,
                   help="fetch http(s) image/video URLs (default: data: URLs only)")
    m.add_argument("--max-media-bytes", type=int, default=None)
    m.add_argument("--max-media-per-prompt", type=int, default=None)
    m.add_argument("--media-fetch-timeout-s", type=float, default=None)
    m.add_argument("--placement-strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"], default=None)
    m.add_argument("--moe-dispatch", choices=["router", "direct", "compiled"], default=None,
                   help="MoE rows from each stage straight to its shards by actor calls (direct, the default), "
                   "through the stage's router actor (router) or through a Ray Compiled Graph (compiled)")
    m.add_argument("--torch-threads", type=int, default=None)
    m.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="an undistributed model's engine in its own process, apart from HTTP handling (default on)")
    a = p.add_argument_group("replicas and admission")
    a.add_argument("--min-replicas", type=int, default=None, help="default 1")
    a.add_argument("--max-replicas", type=int, default=None, help="default 1 (no autoscaling)")
    a.add_argument("--initial-replicas", type=int, default=None)
    a.add_argument("--target-ongoing-requests", type=float, default=None, help="autoscaling target per replica (2)")
    a.add_argument("--upscale-delay-s", type=float, default=None, help="default 30")
    a.add_argument("--downscale-delay-s", type=float, default=None, help="default 600")
    a.add_argument("--metrics-interval-s", type=float, default=None)
    a.add_argument("--look-back-period-s", type=float, default=None)
    a.add_argument("--max-ongoing-requests", type=int, default=None, help="per replica (default: --max-num-seqs)")
    a.add_argument("--max-queued-requests", type=int, default=None, help="queue before 429 (256; -1: none)")
    a.add_argument("--retry-after-s", type=float, default=None, help="Retry-After of a 429 (default 1)")
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch (64)")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (2048)")
    e.add_argument("--max-model-len", type=int, default=None, help="context limit (default: what the cache holds)")
    e.add_argument("--block-size", type=int, default=None, help="MLA cache block size (16)")
    e.add_argument("--cache-memory-mb", type=float, default=None, help="cache memory per replica (256)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--speculative-ngram", type=int, default=None, help="n-gram draft tokens per step (0: off)")
    e.add_argument("--seed", type=int, default=None)


def app_args(args: argparse.Namespace) -> dict:
    out = {name: getattr(args, name) for name in APP_FLAGS if getattr(args, name, None) is not None}
    if "api_key" not in out and os.environ.get("K3RAY_API_KEY"):
        out["api_key"] = os.environ["K3RAY_API_KEY"]
    return out


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from k3ray.actors.serve_config import ServeArgs

    try:
        ServeArgs.model_validate(app_args(args))
    except ValidationError as e:
        raise ValueError(str(e)) from None
    from k3ray.actors import serve_launch

    if args.address is not None and args.ingress is not None:
        raise ValueError("--ingress applies to the local Ray instance k3ray serve starts; a cluster joined with "
                         "--address keeps the ingress its nodes started with (RAY_SERVE_ENABLE_HA_PROXY)")
    init = {} if args.num_cpus is None else {"num_cpus": args.num_cpus}
    owns_ray = serve_launch.start_ray(args.address, args.ingress or serve_launch.DEFAULT_INGRESS, **init)
    # Ctrl-C / SIGTERM only set a flag: one that lands while Serve is deploying must not be lost
    # inside Ray's own waits (it was, under load), and the loop below then shuts down cleanly
    stop = threading.Event()

    def request_stop(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts the shutdown

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        url = serve_launch.deploy(app_args(args), host=args.host, port=args.port)
        print(f"k3ray serve: OpenAI API at {url}/v1 (Ctrl-C to stop)", flush=True)
        while not stop.is_set():
            time.sleep(0.2)
        print("k3ray serve: shutting down", file=sys.stderr, flush=True)
    finally:
        serve_launch.stop(owns_ray)
    return 0


if __name__ == "__main__":  # `python -m k3ray.actors.serve_cli ...`, the same as `k3ray serve ...`
    parser = argparse.ArgumentParser(prog="k3ray serve", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
