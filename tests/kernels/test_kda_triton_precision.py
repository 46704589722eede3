"""The Triton KDA prefill's dot precisions, checked on CPU: under the interpreter, products asked
for in TF32 get their fp32 operands truncated to TF32's 10-bit mantissa (what a Hopper tensor core
reads from an fp32 register; tf32x3 is fp32-accurate there and stays exact here).

With bf16 inputs the state recurrence multiplies in TF32 (it spills in tf32x3, see
`k3ray bench compile`); the intra-chunk products and the output stay tf32x3, because in TF32 they
would add about as much error to the output as its own bf16 rounding (measured 1.2x the output's
error each at T = 1024). Sizes: K = V = 128 is K3's head; 8 chunks carry the state's error
through the recurrence; H = 2 keeps the interpreter to seconds."""

import numpy as np
import pytest
import torch
from triton.runtime import interpreter

from k3ray.bench.kernel_cases.kda import make_inputs
from k3ray.kernels.kda.chunk_cpu import chunk_kda_cpu
from k3ray.kernels.kda.chunk_triton import chunk_kda_triton
from k3ray.kernels.triton_dots import interpreting
from k3ray.testing import rel_rmse

T, H, K = 512, 2, 128
TF32_DROPPED_BITS = np.uint32(0xFFFFE000)  # fp32 keeps 23 mantissa bits, TF32 10


@pytest.fixture
def tf32_products(monkeypatch):
    """Switch: while on, the interpreter's TF32 dots truncate their fp32 operands to TF32."""
    state = {"on": False}
    exact = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if state["on"] and input_precision == interpreter._ir.INPUT_PRECISION.TF32:
            a, b = (interpreter.TensorHandle((x.data.view(np.uint32) & TF32_DROPPED_BITS).view(np.float32), x.dtype)
                    if x.data.dtype == np.float32 else x for x in (a, b))
        return exact(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    return state


@pytest.mark.skipif(not interpreting(), reason="emulates TF32 inside Triton's CPU interpreter")
def test_bf16_prefill_error_unchanged_by_tf32_state_products(tf32_products):
    q, k, v, g, beta = make_inputs(T, H, K, K, "cpu", dtype=torch.bfloat16, seed=3)
    S0 = torch.randn(1, H, K, K, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, T])
    o_ref, S_ref = chunk_kda_cpu(q.float(), k.float(), v.float(), g, beta, K**-0.5, S0, cu)
    o_exact, S_exact = chunk_kda_triton(q, k, v, g, beta, K**-0.5, S0, cu)
    tf32_products["on"] = True
    o_tf32, S_tf32 = chunk_kda_triton(q, k, v, g, beta, K**-0.5, S0, cu)
    err_S_exact, err_S = rel_rmse(S_ref, S_exact), rel_rmse(S_ref, S_tf32)
    assert err_S > 10 * err_S_exact, "TF32 emulation had no effect"
    # fla-core keeps its chunk states in bf16 (relative rounding up to 2^-9 ~ 2e-3)
    assert err_S < 2e-3, f"final state {err_S:.2e}"
    err_o_exact, err_o = rel_rmse(o_ref, o_exact), rel_rmse(o_ref, o_tf32)
    assert err_o <= 1.05 * err_o_exact, f"output {err_o:.3e} vs {err_o_exact:.3e} with exact products"
