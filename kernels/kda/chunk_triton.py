"""Triton KDA chunkwise prefill over packed variable-length sequences (three launches:
chunk_intra, then the state recurrence and the output of chunk_inter)."""

from __future__ import annotations

import torch
import triton

from k3ray.kernels.kda.chunk_cpu import safe_subchunk
from k3ray.kernels.kda.chunk_inter_triton import chunk_kda_fwd_kernel_o, chunk_kda_fwd_kernel_state
from k3ray.kernels.kda.chunk_intra_triton import chunk_kda_fwd_kernel_intra
from k3ray.kernels.kda.varlen import chunk_layout

# tf32x3 keeps fp32 accuracy on tensor cores; launch settings were picked from ptxas
# register / spill reports for sm_90 at K = V = 128 (no spills, or a few hundred bytes in phase 2)
INTRA = dict(DOT="tf32x3", num_warps=8, num_stages=1)
STATE = dict(DOT="tf32x3", num_warps=4, num_stages=1)
OUTPUT = dict(DOT="ieee", num_warps=8, num_stages=1)


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
    BV = 16
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
        chunk_kda_fwd_kernel_state[(triton.cdiv(V, BV), N * H)](
            k, G, W, U, v_new, h, init, final, cu, lay.chunk_offsets,
            H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, USE_INITIAL_STATE=initial_state is not None, **STATE,
        )
    o = torch.empty_like(v)
    if NC:
        chunk_kda_fwd_kernel_o[(triton.cdiv(V, BV), NC, H)](
            q, G, h, Aqk, v_new, o, cu, lay.chunk_indices.contiguous(), scale,
            H=H, K=K, V=V, BT=BT, BK=BK_intra, BV=BV, **OUTPUT,
        )
    return o, final
