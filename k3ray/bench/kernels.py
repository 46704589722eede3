"""`k3ray bench kernels`: per-op timings at K3 and tiny shapes, plus KDA prefill vs fla-core's
pure-PyTorch `naive_chunk_kda` on CPU.

Each op folder of k3ray.kernels has its cases in `k3ray.bench.kernel_cases.<op>`:
`cases(device, quick) -> list[dict]` (keys op, shape, fn, bytes, flops, optional baselines).
With --compare each case is timed interleaved with its baselines (kernel_cases/baselines.py); one
that cannot run here is reported with the reason.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
import warnings
from typing import Any, Callable

from k3ray.bench.common import machine, median_time
from k3ray.cli_flags import add_deprecated_alias
from k3ray.device_flags import add_device_argument
from k3ray.model_names import CONFIG, set_model_kind
from k3ray.threads import add_threads_argument, set_threads

HELP = "per-op kernel timings at K3 and tiny shapes"
OP_MODULES = ("kda", "conv", "mla", "attn_res", "moe")
# H200 SXM: HBM3e bandwidth and dense bf16 tensor-core peak
H200_BYTES_PER_S = 4.8e12
H200_FLOPS = 790e12  # measured dense bf16 (the 990e12 datasheet figure is not reached)
TINY_LABEL = "k3-tiny"
MODEL_SHAPES = ("k3", TINY_LABEL)  # a case's shape label starts with one of them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer cases and repeats")
    add_device_argument(parser)
    parser.add_argument("--ops", default=",".join(OP_MODULES), help="comma-separated op folders to run")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (default: 5, --quick 2)")
    parser.add_argument("--model", choices=MODEL_SHAPES, default=None,
                        help="only the cases at this model's shapes (k3-tiny: a smoke run; default: both)")
    add_deprecated_alias(parser, "--tiny", "--model k3-tiny", action="store_const", dest="model", const=TINY_LABEL)
    set_model_kind(parser, CONFIG)  # preset names (argparse's choices hold it to MODEL_SHAPES)
    parser.add_argument("--compare", action="store_true",
                        help="time every case interleaved with its baselines (fla-core, torch, naive.py); "
                             "rows gain baseline, baseline_ms, speedup_vs_baseline")
    parser.add_argument("--naive-ratio-heads", type=int, default=None,
                        help="heads for the CPU kda_prefill_vs_naive_chunk ratio at T=4096, K=V=128 "
                             "(default 16, quick 8)")
    parser.add_argument("--no-naive-ratio", action="store_true",
                        help="skip the CPU kda_prefill_vs_naive_chunk ratio (fla naive_chunk_kda)")
    add_threads_argument(parser)


def _synced(fn: Callable[[], Any], device: str) -> Callable[[], Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    if not device.startswith("cuda"):
        return fn

    def run() -> None:
        fn()
        torch.cuda.synchronize()

    return run


def _row(case: dict[str, Any], device: str, seconds: float) -> dict[str, Any]:
    nbytes, flops = case.get("bytes"), case.get("flops")
    tb_s = nbytes / seconds / 1e12 if nbytes else None
    tflops = flops / seconds / 1e12 if flops else None
    frac = None
    if device.startswith("cuda") and (nbytes or flops):
        bound = max((nbytes or 0) / H200_BYTES_PER_S, (flops or 0) / H200_FLOPS)
        frac = bound / seconds
    return {"op": case["op"], "shape": case["shape"], "device": device, "ms": seconds * 1e3,
            "tb_s": tb_s, "tflops": tflops, "roofline_frac": frac}


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each fn, timed round by round in turn (each already warmed up)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def compare_case(case: dict[str, Any], device: str, repeats: int) -> tuple[float, dict[str, Any]]:
    """(our seconds, the row's baseline fields): the case and each baseline that runs here, timed
    interleaved; `baseline` is the fastest of them, `baselines` has every time or skip reason."""
    fns = {"ours": _synced(case["fn"], device)}
    skipped = {}
    for name, factory in case.get("baselines", {}).items():
        try:
            fn = _synced(factory(), device)
            fn()  # the warm-up also proves it runs here
            fns[name] = fn
        except Exception as e:  # noqa: BLE001 -- a baseline that cannot run is reported, not fatal
            skipped[name] = f"{type(e).__name__}: {e}"[:300]
    fns["ours"]()
    seconds = _interleaved(fns, repeats)
    ours = seconds.pop("ours")
    best = min(seconds, key=seconds.get) if seconds else None
    fields = {
        "baseline": best,
        "baseline_ms": None if best is None else seconds[best] * 1e3,
        "speedup_vs_baseline": None if best is None else seconds[best] / ours,
        "baselines": {**{n: {"ms": t * 1e3, "speedup": t / ours} for n, t in seconds.items()},
                      **{n: {"skipped": why} for n, why in skipped.items()}},
    }
    return ours, fields


def _op_modules(ops: list[str]) -> list[Any]:
    """The case modules of the op folders."""
    return [importlib.import_module(f"k3ray.bench.kernel_cases.{op}") for op in ops]


def compare_with_fla_naive_chunk(heads: int, repeats: int, T: int = 4096, K: int = 128) -> dict[str, Any] | None:
    """fla naive_chunk_kda seconds / ours on CPU, interleaved, medians; None without fla-core."""
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fla.ops.kda.naive import naive_chunk_kda  # lazy: fla-core is a test-only dependency, optional here
    except ImportError:
        return None
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    from k3ray.bench.kernel_cases.kda import make_inputs
    from k3ray.kernels.kda.dispatch import chunk_kda

    q, k, v, g, beta = make_inputs(T, heads, K, K, "cpu", dtype=torch.float32)
    S0 = torch.zeros(1, heads, K, K)
    cu = torch.tensor([0, T])
    ours = lambda: chunk_kda(q, k, v, g, beta, K**-0.5, S0, cu)  # noqa: E731
    theirs = lambda: naive_chunk_kda(q[None], k[None], v[None], g[None], beta[None], K**-0.5, S0, True)  # noqa: E731
    ours()
    t_ours, t_theirs = [], []
    for _ in range(repeats):
        for fn, times in ((theirs, t_theirs), (ours, t_ours)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    ours_s, theirs_s = statistics.median(t_ours), statistics.median(t_theirs)
    return {"ratio": theirs_s / ours_s, "ours_s": ours_s, "fla_naive_chunk_s": theirs_s,
            "shape": f"T={T} H={heads} K=V={K} fp32", "repeats": repeats}


def run(args: argparse.Namespace) -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} asked for, but CUDA is not available")
    repeats = args.repeats or (2 if args.quick else 5)
    set_threads(args.threads)
    load_before = os.getloadavg()[0]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = sorted(set(ops) - set(OP_MODULES))
    if unknown:
        raise ValueError(f"--ops: unknown op folders {unknown}; choose from {list(OP_MODULES)}")
    rows = []
    with torch.inference_mode():
        for module in _op_modules(ops):  # one module's inputs alive at a time
            for case in module.cases(device, args.quick):
                if args.model is not None and case["shape"].split()[0] != args.model:
                    continue
                if args.compare:
                    seconds, fields = compare_case(case, device, repeats)
                    rows.append({**_row(case, device, seconds), **fields})
                else:
                    seconds = median_time(_synced(case["fn"], device), repeats=repeats, warmup=1)
                    rows.append(_row(case, device, seconds))
        compare = None
        if not args.no_naive_ratio and args.model is None and "kda" in ops:
            heads = args.naive_ratio_heads or (8 if args.quick else 16)
            compare = compare_with_fla_naive_chunk(heads, 1 if args.quick else 3)
    return {
        "machine": machine(),
        "config": {"device": device, "quick": args.quick, "model": args.model, "side_by_side": args.compare,
                   "repeats": repeats, "ops": ops, "threads": torch.get_num_threads(),
                   "load_avg_1min": [load_before, os.getloadavg()[0]], "compare": compare},
        "kda_prefill_vs_naive_chunk": None if compare is None else compare["ratio"],
        "ops": rows,
    }
