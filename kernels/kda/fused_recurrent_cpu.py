"""KDA token-by-token recurrence over a state pool in plain PyTorch (the CPU decode / speculative
path), batched over sequences and heads."""

from __future__ import annotations

import torch


def fused_recurrent_kda_cpu(
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
    """q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state_pool [S, H, K, V] fp32;
    initial_slots [N] (< 0: start from zeros); out_slots [N, Q] (token j of sequence i leaves its
    state in state_pool[out_slots[i, j]]; < 0: not stored) -> o [T, H, V] in v's dtype.
    Every initial state is read before any slot is written."""
    N = cu_seqlens.numel() - 1
    H, K = q.shape[1:]
    V = v.shape[-1]
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    init = initial_slots.long()
    outs = out_slots.long()
    has_init = (init >= 0).nonzero()[:, 0]
    if has_init.numel() == N:
        S = state_pool.index_select(0, init).float()
    else:
        S = torch.zeros(N, H, K, V, dtype=torch.float32, device=q.device)
        S.index_copy_(0, has_init, state_pool.index_select(0, init[has_init]).float())
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    seqs = torch.arange(N, device=q.device)
    for j in range(int(lens.max()) if N else 0):
        active = seqs[lens > j]
        everyone = active.numel() == N
        t = cu[active] + j
        q_t, k_t, v_t = q[t].float() * scale, k[t].float(), v[t].float()  # [n, H, *]
        S_a = S if everyone else S[active]  # [n, H, K, V], updated in place
        S_a.mul_(g[t].float().exp()[..., None])  # decay scales key-dim rows
        u = beta[t].float()[..., None] * (v_t - (k_t[..., None, :] @ S_a)[..., 0, :])  # [n, H, V]
        S_a.view(-1, K, V).baddbmm_(k_t.reshape(-1, K, 1), u.reshape(-1, 1, V))
        o[t] = (q_t[..., None, :] @ S_a)[..., 0, :]
        if not everyone:
            S[active] = S_a
        slots = outs[active, j]
        keep = (slots >= 0).nonzero()[:, 0]
        state_pool.index_copy_(0, slots[keep], S_a[keep].to(state_pool.dtype))
    return o.to(v.dtype)
