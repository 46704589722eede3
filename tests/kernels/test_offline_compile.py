"""`k3ray bench compile`: every launched Triton kernel compiles for sm_90 at K3's shapes (no GPU:
Triton ships ptxas), within an H200's registers and shared memory, without spills, and every
kernel that multiplies tiles does it on tensor cores. The interpreter that runs the parity tests
skips Triton's type and layout checks and says nothing about registers; this does not."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from k3ray.kernels.offline_compile import H200, blocks_per_multiprocessor

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def _jit_kernels() -> dict[str, bool]:
    """Every @triton.jit function named *kernel* in kernels/*/*_triton.py -> whether it calls tl.dot."""
    found = {}
    for path in KERNELS.glob("*/*_triton.py"):
        for node in ast.parse(path.read_text()).body:
            jit = isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
            if jit and "kernel" in node.name:
                found[node.name] = "tl.dot(" in ast.unparse(node) or "_matmul_tile(" in ast.unparse(node)
    return found


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compile") / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter replaces the kernels
    done = subprocess.run([sys.executable, "-m", "k3ray.cli", "bench", "compile", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=400, cwd=out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_launched_kernel_compiles_for_sm90(report):
    kernels = _jit_kernels()
    assert len(kernels) >= 12, sorted(kernels)
    assert {r["kernel"] for r in report["kernels"]} == set(kernels)
    assert report["config"]["target"] == "cuda sm_90"


def test_kernels_fit_an_h200_without_spills(report):
    for row in report["kernels"]:
        where = f"{row['kernel']} at {row['shape']}"
        assert row["registers"] <= 255 and row["fits_shared"], where
        assert row["blocks_per_sm"] >= 1, where
        assert row["spill_store"] == row["spill_load"] == 0, f"{where} spills to local memory"
    assert report["kernels_spilling"] == [] and report["kernels_over_shared"] == []


def test_tile_products_run_on_tensor_cores(report):
    dots = {name for name, has_dot in _jit_kernels().items() if has_dot}
    assert {"chunk_kda_fwd_kernel_o", "mla_decode_fwd_kernel_split", "moe_gate_up_fwd_kernel"} <= dots
    for row in report["kernels"]:
        if row["kernel"] in dots:
            assert row["tensor_core"] > 0, f"{row['kernel']} at {row['shape']} multiplies tiles with FMA"


def test_occupancy_arithmetic():
    # 255 registers -> 8,192 a warp (units of 256): 8 warps fit, 2 blocks of 4; shared allows 3
    assert blocks_per_multiprocessor(255, 4, 74752, H200) == 2
    assert blocks_per_multiprocessor(32, 4, 0, H200) == 16  # 64 warps a multiprocessor
    assert blocks_per_multiprocessor(32, 1, 0, H200) == 32  # 32 blocks a multiprocessor
    assert blocks_per_multiprocessor(64, 4, 120 * 1024, H200) == 1  # shared bound
