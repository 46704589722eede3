"""Shared benchmark helpers: the machine description, timing with medians, JSON output."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from importlib import metadata
from typing import Any, Callable


def under_torch(mode: str) -> Callable[[Callable], Callable]:
    """Decorator running a function under `torch.<mode>()` (no_grad, inference_mode), importing
    torch only when it is called, so a benchmark's module (and its --help) loads without torch."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
            import torch

            with getattr(torch, mode)():
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def machine() -> dict[str, Any]:
    # lazy: torch stays out of `k3ray bench --help` (it loads every benchmark)
    import torch

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    info["triton"], info["ray"] = _version("triton"), _version("ray")  # metadata: the core never imports ray
    return info


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of fn() over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_json(result: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


def print_table(result: dict[str, Any]) -> None:
    for key, value in result.items():
        if key in ("machine", "config"):
            continue
        if isinstance(value, list) and value and isinstance(value[0], dict):
            cols = list(value[0])
            print(f"{key}:")
            print("  " + " | ".join(cols))
            for row in value:
                print("  " + " | ".join(_fmt(row.get(c)) for c in cols))
        else:
            print(f"{key}: {_fmt(value)}")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
