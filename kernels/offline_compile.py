"""Compile the Triton kernels for a GPU without one: a launcher runs on CPU tensors with its
launches recorded instead of run, each recorded launch is compiled for the target exactly as a GPU
launch with those arguments would be (same constexprs, options and alignment specialisation), and
the cubin's registers, spills, shared memory and instruction mix are read back with the
cuobjdump / nvdisasm that ship with Triton.

This checks what a GPU run would otherwise find first (a kernel that does not compile, spills or
asks for more shared memory than the part has) and shows how a kernel will use the GPU (tensor
cores or FMA, occupancy, waves); it measures no time. Private Triton APIs (the launch binder) are
used, so it follows the installed triton (3.9 on the development machine)."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from k3ray.kernels.triton_dots import interpreting


@dataclass(frozen=True)
class GpuLimits:
    """Per-multiprocessor limits used for the occupancy estimate (Hopper: sm_90)."""

    name: str
    multiprocessors: int
    registers: int = 65536
    shared_bytes: int = 233472  # 228 KiB per multiprocessor
    shared_bytes_per_block: int = 232448  # 227 KiB, the opt-in maximum for one block
    reserved_shared_per_block: int = 1024  # the driver's per-block reservation
    warps: int = 64
    blocks: int = 32


H200 = GpuLimits("H200 (sm_90, 132 SMs)", multiprocessors=132)

# instruction classes counted in the SASS (static counts: a loop body counts once)
CLASSES = {
    "tensor_core": ("HGMMA", "HMMA", "IMMA", "QGMMA"),
    "fp32_fma": ("FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2"),
    "special_fn": ("MUFU",),
    "global_load": ("LDG", "LDGSTS", "UTMALDG"),
    "global_store": ("STG", "UTMASTG"),
    "atomic": ("RED", "ATOM", "ATOMG", "REDG"),
    "shared_access": ("LDS", "STS", "LDSM", "STSM"),
    "spill_store": ("STL",),
    "spill_load": ("LDL",),
}
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_RESOURCE = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")


@dataclass(frozen=True)
class Launch:
    kernel: Any  # triton JITFunction
    args: tuple
    kwargs: dict
    grid: tuple[int, ...]


@contextlib.contextmanager
def recording_launches() -> Iterator[list[Launch]]:
    """Within the block, `kernel[grid](...)` records a Launch instead of running."""
    if interpreting():
        raise ValueError("unset TRITON_INTERPRET: under the interpreter the kernels are not compiled, only run on CPU")
    launches: list[Launch] = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        assert isinstance(grid, tuple), f"{self.__name__}: only tuple grids are recorded, got {grid!r}"
        launches.append(Launch(self, args, dict(kwargs), tuple(int(g) for g in grid)))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def compile_launch(launch: Launch, arch: int = 90) -> Any:
    """The CompiledKernel a CUDA launch with these arguments would build on an sm_`arch` part."""
    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _nvidia_tool(name: str) -> str:
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} is not shipped with this triton ({path})")
    return path


def cubin_profile(cubin: bytes) -> dict[str, Any]:
    """Registers, stack and static shared bytes (cuobjdump -res-usage) and SASS opcode counts."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                               check=True, timeout=60).stdout
        sass = subprocess.run([_nvidia_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True,
                              timeout=60).stdout
    resources = {k: int(v) for k, v in _RESOURCE.findall(usage)}
    opcodes = collections.Counter(m.group(1) for m in _OPCODE.finditer(sass))
    mix = {cls: sum(opcodes[op] for op in ops) for cls, ops in CLASSES.items()}
    return {"registers": resources.get("REG", 0), "stack_bytes": resources.get("STACK", 0),
            "static_shared_bytes": resources.get("SHARED", 0), "instructions": sum(opcodes.values()), **mix}


def blocks_per_multiprocessor(registers: int, num_warps: int, shared_bytes: int, gpu: GpuLimits) -> int:
    """Resident blocks of one kernel per multiprocessor, by registers, shared memory and warps."""
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = (gpu.registers // regs_per_warp) // num_warps
    by_shared = gpu.shared_bytes // (shared_bytes + gpu.reserved_shared_per_block)
    by_warps = gpu.warps // num_warps
    return max(0, min(by_regs, by_shared, by_warps, gpu.blocks))


def _constexpr_summary(launch: Launch) -> dict[str, Any]:
    names = [p.name for p in launch.kernel.params if p.is_constexpr]
    return {n: launch.kwargs[n] for n in names if n in launch.kwargs and isinstance(launch.kwargs[n], (int, str, bool))}


def profile_launches(fn: Callable[[], Any], arch: int = 90, gpu: GpuLimits = H200) -> list[dict[str, Any]]:
    """Run fn (a launcher on CPU tensors) with launches recorded; one row per distinct compiled kernel.
    waves: the launch's programs over what the GPU holds at once (multiprocessors x resident blocks)."""
    with recording_launches() as launches:
        fn()
    rows, seen = [], set()
    for launch in launches:
        compiled = compile_launch(launch, arch)
        if compiled.hash in seen:
            continue
        seen.add(compiled.hash)
        meta = compiled.metadata
        prof = cubin_profile(compiled.asm["cubin"])
        shared = int(meta.shared) + prof["static_shared_bytes"]
        blocks = blocks_per_multiprocessor(prof["registers"], meta.num_warps, shared, gpu)
        programs = math.prod(launch.grid)
        rows.append({
            "kernel": launch.kernel.__name__,
            "grid": list(launch.grid),
            "num_warps": meta.num_warps,
            "num_stages": meta.num_stages,
            "constexprs": _constexpr_summary(launch),
            **{k: v for k, v in prof.items() if k != "static_shared_bytes"},
            "shared_bytes": shared,
            "fits_shared": shared <= gpu.shared_bytes_per_block,
            "blocks_per_sm": blocks,
            "waves": programs / (gpu.multiprocessors * blocks) if blocks else None,
        })
    return rows
