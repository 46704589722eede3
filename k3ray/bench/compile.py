"""`k3ray bench compile`: every Triton kernel compiled for a GPU at K3's shapes without one
(Triton ships ptxas, cuobjdump and nvdisasm): registers, spills, shared memory, resident blocks
per multiprocessor and waves on an H200, and the SASS instruction mix (tensor-core vs fp32 FMA).
A static report: it measures no time, and needs TRITON_INTERPRET unset.

Each op folder of k3ray.kernels has its launches in `k3ray.bench.kernel_launches.<op>`:
`launches() -> list[dict]` (keys op, shape, fn: a Triton launcher called on CPU tensors at K3's
shapes)."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from k3ray.bench.common import machine
from k3ray.bench.kernels import OP_MODULES
from k3ray.threads import add_threads_argument, set_threads

HELP = "Triton kernels compiled for sm_90 at K3 shapes without a GPU: registers, spills, shared memory, MMA use"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", default=",".join(OP_MODULES), help="comma-separated op folders to compile")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as an integer")
    add_threads_argument(parser)


def launch_modules(ops: list[str]) -> list[Any]:
    unknown = sorted(set(ops) - set(OP_MODULES))
    if unknown:
        raise ValueError(f"--ops: unknown op folders {unknown}; choose from {list(OP_MODULES)}")
    return [importlib.import_module(f"k3ray.bench.kernel_launches.{op}") for op in ops]


def run(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: triton and the offline compiler stay out of `k3ray bench --help`
    import triton

    from k3ray.kernels.offline_compile import H200, profile_launches

    set_threads(args.threads)

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    rows = []
    for module in launch_modules(ops):
        for case in module.launches():
            for row in profile_launches(case["fn"], arch=args.arch, gpu=H200):
                rows.append({"op": case["op"], "shape": case["shape"], **row})
    spilling = sorted({r["kernel"] for r in rows if r["spill_store"] or r["spill_load"]})
    return {
        "machine": machine(),
        "config": {"target": f"cuda sm_{args.arch}", "triton": triton.__version__, "occupancy_for": H200.name,
                   "ops": ops},
        "kernels_compiled": len(rows),
        "kernels_spilling": spilling,
        "kernels_over_shared": sorted({r["kernel"] for r in rows if not r["fits_shared"]}),
        "kernels_without_tensor_cores": sorted({r["kernel"] for r in rows if not r["tensor_core"]}),
        "kernels": rows,
    }
