"""KDA chunkwise prefill in plain PyTorch, vectorised over chunks and heads (the CPU fast path).

Every sequence is padded to a multiple of the chunk size (a padded token has k = v = beta = g = 0,
a no-op step). The intra-chunk work (A_kk, A_qk, the triangular solve, W, U) runs on all chunks
at once; only the state recurrence walks the chunks, batched over sequences and heads.
Math and the factorised intra-chunk scheme: kernels/kda/README.md.
"""

from __future__ import annotations

import torch

from k3ray.kernels.kda.varlen import ChunkLayout, chunk_layout

# the largest exponent a factor may reach in the factorised intra-chunk products (e^80 < fp32 max)
MAX_EXPONENT = 80.0


def safe_subchunk(g_min: float, chunk_size: int, max_sub: int = 16) -> int:
    """The largest power-of-two sub-chunk (<= max_sub) whose in-sub-chunk decay span stays within
    MAX_EXPONENT: with K3's gate bound of -5 this is 16 (15 * 5 = 75)."""
    sub = max_sub
    while sub > 1 and (sub - 1) * max(-g_min, 0.0) > MAX_EXPONENT:
        sub //= 2
    assert chunk_size % sub == 0, f"chunk_size {chunk_size} is not a multiple of the sub-chunk {sub}"
    return sub


def suffix_products(decay: torch.Tensor) -> torch.Tensor:
    """decay [..., R, K] -> [..., R, K] with row i = prod of decay over rows (i, R): exp(G_last - G_i)
    as a running product (1 on the last row)."""
    ones = torch.ones_like(decay[..., :1, :])
    return torch.cat([decay[..., 1:, :].flip(-2).cumprod(-2).flip(-2), ones], -2)


def intra_chunk(
    q: torch.Tensor, k: torch.Tensor, decay: torch.Tensor, sub: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted products within each chunk, without the pairwise [C, C, K] exponent tensor.

    q, k, decay [..., C, K] (decay = exp(g) per row; q already scaled) ->
    (A_kk [..., C, C] strictly lower, A_qk [..., C, C] lower incl. the diagonal), with
    A[r, i] = sum_c x_r[c] k_i[c] exp(G_r[c] - G_i[c]).
    Column block b uses the decay at its last row e as reference: exp(G_e - G_i) <= 1 for i in b,
    exp(G_r - G_e) <= 1 for r after b, and <= exp(MAX_EXPONENT) for r inside b. Both factors are
    running products of exp(g) from e, so a pair's factor carries the rounding of the steps
    between them, as the recurrence does, not that of a cumulative log decay far from zero.
    """
    C = q.shape[-2]
    A_kk = q.new_zeros(*q.shape[:-1], C)
    A_qk = q.new_zeros(*q.shape[:-1], C)
    for b0 in range(0, C, sub):
        e = b0 + sub - 1
        to_ref = suffix_products(decay[..., b0 : e + 1, :])  # [..., sub, K] exp(G_e - G_i)
        right = (k[..., b0 : e + 1, :] * to_ref).transpose(-1, -2)  # [..., K, sub]
        left = torch.cat([to_ref.reciprocal(), decay[..., e + 1 :, :].cumprod(-2)], -2)  # [..., C - b0, K]
        A_kk[..., b0:, b0 : e + 1] = (k[..., b0:, :] * left) @ right
        A_qk[..., b0:, b0 : e + 1] = (q[..., b0:, :] * left) @ right
    rows = torch.arange(C, device=q.device)
    A_kk = A_kk.masked_fill(rows[:, None] <= rows[None, :], 0.0)
    A_qk = A_qk.masked_fill(rows[:, None] < rows[None, :], 0.0)
    return A_kk, A_qk


def _to_chunks(x: torch.Tensor, dest: torch.Tensor, num_chunks: int, C: int) -> torch.Tensor:
    """[T, H, D] packed -> [NC, H, C, D] fp32, zero-padded per sequence."""
    T, H, D = x.shape
    buf = x.new_zeros(num_chunks * C, H, D, dtype=torch.float32)
    buf[dest] = x.float()
    return buf.view(num_chunks, C, H, D).transpose(1, 2).contiguous()


def chunk_kda_cpu(
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
    """Packed prefill: q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; initial_state [N, H, K, V]
    -> (o [T, H, V] in v's dtype, final_state [N, H, K, V] fp32)."""
    T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = cu_seqlens.numel() - 1
    lay = chunk_layout(cu_seqlens.to(q.device), C)
    NC = lay.total_chunks
    qc, kc, vc, gc = (_to_chunks(x, lay.dest, NC, C) for x in (q, k, v, g))  # [NC, H, C, *]
    bc = _to_chunks(beta[..., None], lay.dest, NC, C)  # [NC, H, C, 1]
    qc = qc * scale
    decay = gc.exp()  # exp(g); exp(G) and its ratios are running products of it
    sub = safe_subchunk(float(g.min()) if g.numel() else 0.0, C)
    A_kk, A_qk = intra_chunk(qc, kc, decay, sub)
    # (I + L) [W | U] = beta * [exp(G) k | v] with L = beta_r A_kk unit-lower-triangular
    exp_G = decay.cumprod(-2)
    rhs = bc * torch.cat([exp_G * kc, vc], -1)
    WU = torch.linalg.solve_triangular(bc * A_kk, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]  # [NC, H, C, K], [NC, H, C, V]

    # padded rows have decay 1, so the last row's exp(G) is the decay up to the last real row
    k_decayed = (suffix_products(decay) * kc).transpose(-1, -2)  # [NC, H, K, C] exp(G_last - G) k
    decay_last = exp_G[..., -1:, :].transpose(-1, -2)  # [NC, H, K, 1]
    S = q.new_zeros(N, H, K, V, dtype=torch.float32)
    if initial_state is not None:
        S.copy_(initial_state)
    states, v_new = _walk_chunks(W, U, k_decayed, decay_last, S, lay)
    o = (qc * exp_G) @ states + A_qk @ v_new  # [NC, H, C, V]
    o = o.transpose(1, 2).reshape(NC * C, H, V)[lay.dest]
    return o.to(v.dtype), S


def _walk_chunks(
    W: torch.Tensor, U: torch.Tensor, k_decayed: torch.Tensor, decay_last: torch.Tensor, S: torch.Tensor,
    lay: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequential part, one step per chunk index for all sequences and heads at once; S [N, H,
    K, V] is advanced in place -> (state entering each chunk [NC, H, K, V], v_new [NC, H, C, V]).
    Sequences with fewer chunks run no-op chunks (W = U = k_decayed = 0, decay 1) at the end."""
    N, H, K, V = S.shape
    steps = int(lay.num_chunks.max()) if N else 0
    slot = lay.chunk_indices[:, 1] * N + lay.chunk_indices[:, 0]  # global chunk -> step-major row
    single = N == 1

    def step_major(x: torch.Tensor, pad: float) -> torch.Tensor:  # [NC, H, ...] -> [steps, N * H, ...]
        if not single:
            x = x.new_full((steps * N, *x.shape[1:]), pad).index_copy_(0, slot, x)
        return x.contiguous().view(steps, N * H, *x.shape[2:])

    W_s, U_s, kd_s = step_major(W, 0.0), step_major(U, 0.0), step_major(k_decayed, 0.0)
    decay_s = step_major(decay_last, 1.0)
    states = S.new_empty(steps, N * H, K, V)
    v_new = S.new_empty(steps, N * H, *U.shape[2:])
    S3 = S.view(N * H, K, V)
    for n in range(steps):
        states[n].copy_(S3)
        torch.baddbmm(U_s[n], W_s[n], S3, alpha=-1.0, out=v_new[n])  # U - W S
        S3.mul_(decay_s[n]).baddbmm_(kd_s[n], v_new[n])

    def chunk_major(x: torch.Tensor) -> torch.Tensor:  # [steps, N * H, ...] -> [NC, H, ...]
        x = x.view(steps * N, H, *x.shape[2:])
        return x if single else x.index_select(0, slot)

    return chunk_major(states), chunk_major(v_new)
