"""A backward-capable chunked KDA for training: chunks of 16 computed in parallel, only the
[K, V] state walks chunk to chunk. Same math as `naive_chunk_kda` (WY/UT form); the per-key decay
inside a chunk is factored around the chunk's middle row, which keeps every factor below e^40
for K3's gate bound of -5 per token, so fp32 holds it without overflow. A row whose beta and gate are
zero (padding) leaves the state as it is, so the final state is each row's state at its last real token."""

from __future__ import annotations

import torch

from k3ray.kernels.kda.naive import split_chunks

CHUNK = 16


def chunk_kda_train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] (None: zeros)
    -> o [B, T, H, V] fp32, and with output_final_state the state after the last token [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = CHUNK
    assert -g.min().item() * C / 2 < 80, "gate below the bound the factorisation assumes"
    q, k, v, g, beta = split_chunks(q, k, v, g, beta, C)  # [B, H, N, C, *], beta [B, H, N, C]
    N = q.shape[2]
    G = g.cumsum(-2)  # [B, H, N, C, K]
    mid = G[..., C // 2 : C // 2 + 1, :]
    k_up, k_down = k * (G - mid).exp(), k * (mid - G).exp()  # k_r e^{G_r - m}, k_i e^{m - G_i}
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A_kk = (k_up @ k_down.transpose(-1, -2)).masked_fill(~strict, 0.0) * beta[..., None]  # [B, H, N, C, C]
    eye = torch.eye(C, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + A_kk, torch.diag_embed(beta), upper=False)
    W = Tm @ (G.exp() * k)  # [B, H, N, C, K]
    U = Tm @ v  # [B, H, N, C, V]
    A_qk = ((q * scale * (G - mid).exp()) @ k_down.transpose(-1, -2)).masked_fill(~incl, 0.0)
    G_last = G[..., -1:, :]  # [B, H, N, 1, K]
    k_tail = (G_last - G).exp() * k  # [B, H, N, C, K]
    decay = G_last.transpose(-1, -2).exp()  # [B, H, N, K, 1]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    starts, v_news = [], []
    # unbind once: indexing chunk n in the loop would give each step's backward a full-size gradient
    for U_n, W_n, decay_n, k_tail_n in zip(U.unbind(2), W.unbind(2), decay.unbind(2), k_tail.unbind(2)):
        starts.append(S)
        v_new = U_n - W_n @ S
        v_news.append(v_new)
        S = decay_n * S + k_tail_n.transpose(-1, -2) @ v_new
    S_start = torch.stack(starts, 2)  # [B, H, N, K, V]
    v_new = torch.stack(v_news, 2)  # [B, H, N, C, V]
    o = (q * scale * G.exp()) @ S_start + A_qk @ v_new
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return (o, S) if output_final_state else o
