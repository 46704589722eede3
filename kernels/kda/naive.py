"""Reference KDA (Kimi Delta Attention): the recurrence as written, and its chunkwise WY/UT form.

Same signature and layouts as fla-core's `fla.ops.kda.naive`: q, k [B, T, H, K]; v [B, T, H, V];
g [B, T, H, K] log-decay (already activated); beta [B, T, H] (already sigmoided); state
[B, H, K, V] (K-first). q and k are expected L2-normalised; everything is computed in fp32.
Math: kernels/kda/README.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (eps inside the sqrt, as fla)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(
    a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float
) -> torch.Tensor:
    """K3's safe gate: g = lb * sigmoid(exp(A_log[h]) * (a + dt_bias)), in (lb, 0), fp32.

    a [..., H, K]; A_log [>= H] (only the first H entries are used); dt_bias [H * K].
    """
    H, K = a.shape[-2:]
    A = A_log[:H].float().exp()[:, None]  # [H, 1]
    return lower_bound * torch.sigmoid(A * (a.float() + dt_bias.float().view(H, K)))


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]  # decay scales key-dim rows
        k_t = k[:, t]  # [B, H, K]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t[..., None] * u[..., None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, (S if output_final_state else None)


def split_chunks(q, k, v, g, beta, C: int) -> tuple[torch.Tensor, ...]:
    """q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] -> fp32 chunks: q, k, v, g [B, H, N, C, *],
    beta [B, H, N, C], T zero-padded to N * C."""
    B, T, H, _ = q.shape
    pad = (-T) % C
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C
    q, k, v, g = (x.view(B, N, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    return q, k, v, g, beta.view(B, N, C, H).permute(0, 3, 1, 2)


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise form; T need not be a multiple of chunk_size (padding is a no-op step:
    k = v = beta = g = 0 leaves the state unchanged)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = split_chunks(q, k, v, g, beta, C)
    N = q.shape[2]
    q = q * scale
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float().clone()
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    eye = torch.eye(C, device=q.device)
    o = torch.empty_like(v)
    for n in range(N):
        q_n, k_n, v_n, b_n = q[:, :, n], k[:, :, n], v[:, :, n], beta[:, :, n]
        G = g[:, :, n].cumsum(-2)  # [B, H, C, K]
        diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, C(r), C(i), K]
        E = diff.masked_fill(~incl[..., None], float("-inf")).exp()
        L = b_n[..., None] * torch.einsum("bhrk,bhik,bhrik->bhri", k_n, k_n, E) * strict
        Tm = torch.linalg.solve_triangular(eye + L, torch.diag_embed(b_n), upper=False)
        W = Tm @ (G.exp() * k_n)
        U = Tm @ v_n
        v_new = U - W @ S
        A_qk = torch.einsum("bhrk,bhjk,bhrjk->bhrj", q_n, k_n, E)
        o[:, :, n] = (q_n * G.exp()) @ S + A_qk @ v_new
        G_last = G[..., -1:, :]  # [B, H, 1, K]
        S = G_last.transpose(-1, -2).exp() * S + ((G_last - G).exp() * k_n).transpose(-1, -2) @ v_new
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, (S if output_final_state else None)


def naive_recurrent_kda_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    initial_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """Speculative verification over packed sequences (q [T, H, K], ...): sequence i starts from
    state_pool[initial_slots[i]] (zeros if < 0) and leaves the state after its token j in
    state_pool[out_slots[i, j]] (skipped if < 0). All initial states are read first -> o [T, H, V]."""
    N = cu_seqlens.numel() - 1
    H, K, V = q.shape[1], q.shape[2], v.shape[-1]
    starts = [
        state_pool[int(s)].float().clone() if int(s) >= 0 else q.new_zeros(H, K, V, dtype=torch.float32)
        for s in initial_slots
    ]
    o = torch.empty_like(v)
    for i in range(N):
        S = starts[i][None]
        for t in range(int(cu_seqlens[i]), int(cu_seqlens[i + 1])):
            o_t, S = naive_recurrent_kda(
                q[None, t : t + 1], k[None, t : t + 1], v[None, t : t + 1], g[None, t : t + 1],
                beta[None, t : t + 1], scale=scale, initial_state=S, output_final_state=True,
            )
            o[t] = o_t[0, 0].to(v.dtype)
            slot = int(out_slots[i, t - int(cu_seqlens[i])])
            if slot >= 0:
                state_pool[slot] = S[0].to(state_pool.dtype)
    return o
