"""What `k3ray serve` checks before it starts Ray and Serve, in seconds: the checkpoint (its
config, its tensor table, every tensor file's header and size, its tokenizer), whether one
replica's layout fits the CPUs and GPUs at hand, and whether the port is free. Each problem is
one ValueError, which the command prints as one line."""

from __future__ import annotations

import errno
import os
import socket

from k3ray.actors.serve.config import ServeArgs
from k3ray.tokenizer import load_tokenizer
from k3ray.weights.checkpoint_dir import check_shard_files, open_weight_map, read_config


def check_checkpoint(args: ServeArgs) -> None:
    """args must be resolved. Reads config.json, the safetensors index (or single file), each
    tensor file's header (against its size and the index) and the tokenizer, but no weights."""
    path = args.model.model
    assert path is not None, "resolve() the args first"
    if not os.path.isdir(path):
        raise ValueError(f"--model {path!r} is not a directory (a checkpoint: config.json, safetensors, tokenizer)")
    try:
        read_config(path)
    except (OSError, TypeError, KeyError) as e:
        raise ValueError(f"{path}/config.json cannot be read: {type(e).__name__}: {e}") from None
    check_shard_files(*open_weight_map(path))
    load_tokenizer(args.model.tokenizer or path)


def replica_resources(args: ServeArgs) -> dict[str, float]:
    """CPUs and GPUs one replica holds (its own bundle plus its model actors'); args resolved."""
    if not args.distributed:
        return {"CPU": args.parallel.replica_cpus, "GPU": args.parallel.replica_gpus}
    # lazy: torch (under the bundles) only for a distributed layout: the preflight takes seconds
    from k3ray.actors.serve.replica_bundles import replica_bundles

    total: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
    for bundle in replica_bundles(args):
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def check_layout(args: ServeArgs, available: dict[str, float]) -> None:
    """A ValueError if the first `min_replicas` replicas (at least one) cannot be placed on
    `available` (Ray's resource names: CPU, GPU)."""
    replicas = max(1, args.autoscaling.initial_replicas or args.autoscaling.min_replicas)
    need = replica_resources(args)
    for name in ("CPU", "GPU"):
        wanted, have = need.get(name, 0.0) * replicas, available.get(name, 0.0)
        if wanted > have + 1e-9:
            p = args.parallel
            raise ValueError(
                f"{replicas} replica(s) of pipeline {p.pipeline} x expert-parallel {p.expert_parallel} need "
                f"{wanted:g} {name}s, but {have:g} are available: lower --replica-{name.lower()}s, "
                f"--stage-{name.lower()}s, --shard-{name.lower()}s" + (", --router-cpus" if name == "CPU" else "")
                + " or the layout, or give Ray more (--num-cpus, a larger cluster)")


def local_resources(num_cpus: float | None) -> dict[str, float]:
    """What a local Ray instance started with `num_cpus` (None: all) will have."""
    gpus = 0
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        # lazy: torch only to count local GPUs: the preflight takes seconds
        import torch

        gpus = torch.cuda.device_count()
    return {"CPU": float(num_cpus if num_cpus is not None else os.cpu_count() or 1), "GPU": float(gpus)}


def check_port(host: str, port: int) -> None:
    """A ValueError naming host:port if a server could not listen there now: something listens on
    one of the host's addresses, or none of them is this machine's. Bound as HAProxy and Serve's
    proxy bind (SO_REUSEADDR, no SO_REUSEPORT), so a port left in TIME_WAIT passes and one another
    server listens on does not."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    unusable = []
    for family, kind, proto, _, address in addresses:
        shown = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"cannot listen on {shown}: {e.strerror}: stop what listens there or give "
                                     "another --port") from None
                unusable.append(f"{shown}: {e.strerror}")
    if len(unusable) == len(addresses):
        raise ValueError(f"cannot listen on {'; '.join(unusable)}: give another --host or --port")
