"""Triton KDA chunkwise prefill over packed variable-length sequences (three launches:
chunk_intra, then the state recurrence and the output of chunk_inter)."""

from __future__ import annotations

import torch
import triton

from k3ray.kernels.kda.chunk_cpu import safe_subchunk
from k3ray.kernels.kda.chunk_inter_triton import chunk_kda_fwd_kernel_o, chunk_kda_fwd_kernel_state
from k3ray.kernels.kda.chunk_intra_triton import chunk_kda_fwd_kernel_intra
from k3ray.kernels.kda.varlen import chunk_layout

# launch settings from sm_90 compiles at K = V = 128 (`k3ray bench compile`): bf16 inputs compile
# without spills; fp32 inputs spill in the state recurrence (tf32x3 splits every operand in two)
INTRA = dict(DOT="tf32x3", num_warps=8, num_stages=1)
STATE = dict(BV=16, num_warps=4, num_stages=1)
OUTPUT = dict(DOT="tf32x3", num_warps=8, num_stages=1)
OUTPUT_TILE = 64  # the output kernel's BK and BV


def state_dot_precision(dtype: torch.dtype) -> str:
    """The state recurrence's products: tf32x3 (fp32-accurate) for fp32 inputs; single TF32 for
    bf16 / fp16 inputs, finer than the inputs (fla-core multiplies these tiles in bf16), which
    leaves the output's error unchanged (tests/kernels/test_kda_triton_precision.py)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as chunk_cpu.chunk_kda_cpu -> (o [T, H, V] in v's dtype, final [N, H, K, V] fp32)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    T, H, K = q.shape
    V = v.shape[-1]
    BT = chunk_size
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    N = cu.numel() - 1
    lay = chunk_layout(cu, BT)
    NC = lay.total_chunks
    BC = safe_subchunk(float(g.min()) if g.numel() else 0.0, BT)
    BK_intra = min(32, max(16, triton.next_power_of_2(K)))  # several [64, BK] fp32 tiles live at once
    BV_intra = min(32, max(16, triton.next_power_of_2(V)))
    BK = max(16, triton.next_power_of_2(K))
    f32 = dict(dtype=torch.float32, device=q.device)

    G = torch.empty(T, H, K, **f32)
    W = torch.empty(T, H, K, **f32)
    U = torch.empty(T, H, V, **f32)
    Aqk = torch.empty(T, H, BT, **f32)
    if NC:
        chunk_kda_fwd_kernel_intra[(NC, H)](
            q, k, v, g, beta, G, W, U, Aqk, cu, lay.chunk_indices.contiguous(), scale,
            H=H, K=K, V=V, BT=BT, BC=BC, BK=BK_intra, BV=BV_intra, **INTRA,
        )
    h = torch.empty(NC, H, K, V, **f32)
    v_new = torch.empty(T, H, V, **f32)
    final = torch.empty(N, H, K, V, **f32)
    if N:
        init = initial_state.float().contiguous() if initial_state is not None else final
        chunk_kda_fwd_kernel_state[(triton.cdiv(V, STATE["BV"]), N * H)](
            k, G, W, U, v_new, h, init, final, cu, lay.chunk_offsets,
            H=H, K=K, V=V, BT=BT, BK=BK, USE_INITIAL_STATE=initial_state is not None,
            DOT=state_dot_precision(q.dtype), **STATE,
        )
    o = torch.empty_like(v)
    if NC:
        BK_o, BV_o = min(OUTPUT_TILE, BK), min(OUTPUT_TILE, max(16, triton.next_power_of_2(V)))
        chunk_kda_fwd_kernel_o[(triton.cdiv(V, BV_o), NC, H)](
            q, G, h, Aqk, v_new, o, cu, lay.chunk_indices.contiguous(), scale,
            H=H, K=K, V=V, BT=BT, BK=BK_o, BV=BV_o, **OUTPUT,
        )
    return o, final
