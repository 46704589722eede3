"""Vectorised CPU MLA prefill on expanded K/V: the packed sequences are padded into a few batches
of similar shape, one masked SDPA each, the padding waste bounded."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3ray.kernels.mla.online_softmax import accumulation_dtype

MAX_PADDING = 2.0  # a padded prefill group may cost at most this many times its real work


def prefill_groups(lq: list[int], lk: list[int]) -> list[list[int]]:
    """Sequences in groups whose padded [n, max lq, max lk] attention stays within MAX_PADDING of
    their real work: a batch of equal prompts is one group, decode-like rows (lq = 1) another."""
    order = sorted(range(len(lq)), key=lambda i: (lq[i], lk[i]))
    groups: list[list[int]] = []
    work = max_q = max_k = 0
    for i in order:
        grown = (len(groups[-1]) + 1) * max(max_q, lq[i]) * max(max_k, lk[i]) if groups else 0
        if groups and grown <= MAX_PADDING * (work + lq[i] * lk[i]):
            groups[-1].append(i)
            work, max_q, max_k = work + lq[i] * lk[i], max(max_q, lq[i]), max(max_k, lk[i])
        else:
            groups.append([i])
            work, max_q, max_k = lq[i] * lk[i], lq[i], lk[i]
    return groups


def _rows(cu: torch.Tensor, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the chosen sequences: (group-local sequence, index within it, packed row) of every row."""
    lens = cu[seqs + 1] - cu[seqs]
    local = torch.repeat_interleave(torch.arange(seqs.numel()), lens)
    idx = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[local]
    return local, idx, cu[seqs][local] + idx


def _padded_attention(q, k, v, cu_q, cu_k, seqs: torch.Tensor, scale: float, dtype: torch.dtype):
    """One masked SDPA over the chosen sequences padded to a batch -> (packed rows, o [rows, H, Dv])."""
    n, H = seqs.numel(), q.shape[1]
    sq, iq, rows_q = _rows(cu_q, seqs)
    sk, ik, rows_k = _rows(cu_k, seqs)
    lq, lk = (cu_q[seqs + 1] - cu_q[seqs])[:, None, None], (cu_k[seqs + 1] - cu_k[seqs])[:, None, None]
    Mq, Mk = int(lq.max()), int(lk.max())
    qp = torch.zeros(n, Mq, H, q.shape[-1], dtype=dtype)
    kp = torch.zeros(n, Mk, H, k.shape[-1], dtype=dtype)
    vp = torch.zeros(n, Mk, H, v.shape[-1], dtype=dtype)
    qp[sq, iq], kp[sk, ik], vp[sk, ik] = q[rows_q].to(dtype), k[rows_k].to(dtype), v[rows_k].to(dtype)
    r, c = torch.arange(Mq)[None, :, None], torch.arange(Mk)[None, None, :]
    mask = (c <= lk - lq + r) & (c < lk)  # [n, Mq, Mk]
    mask |= (r >= lq) & (c == 0)  # padding rows attend somewhere, then get dropped
    o = F.scaled_dot_product_attention(
        qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), attn_mask=mask[:, None], scale=scale
    )  # [n, H, Mq, Dv]
    return rows_q, o.transpose(1, 2)[sq, iq]


def mla_prefill_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] packed -> o [Tq, H, Dv] (q's dtype)."""
    cu_q, cu_k = cu_seqlens_q.long().cpu(), cu_seqlens_k.long().cpu()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    live = [i for i in range(len(lq)) if lq[i] > 0]
    dtype = accumulation_dtype(q, k, v)
    for group in prefill_groups([lq[i] for i in live], [lk[i] for i in live]):
        rows, o = _padded_attention(q, k, v, cu_q, cu_k, torch.tensor([live[i] for i in group]), scale, dtype)
        out[rows] = o.to(q.dtype)
    return out
