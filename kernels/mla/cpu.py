"""Vectorised CPU MLA attention (fp32 math, fp64 for fp64 inputs, like the naive reference).

Prefill pads the packed sequences into a few batches of similar shape (one masked SDPA each, the
padding waste bounded); decode gathers the latents of all sequences chunk by chunk along the
context and merges the chunks with an online softmax, so memory stays bounded at long contexts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DECODE_CHUNK_ELEMENTS = 1 << 24  # gathered latent values per decode chunk (64 MiB in fp32)


def _acc_dtype(*ts: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in ts:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


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
    dtype = _acc_dtype(q, k, v)
    for group in prefill_groups([lq[i] for i in live], [lk[i] for i in live]):
        rows, o = _padded_attention(q, k, v, cu_q, cu_k, torch.tensor([live[i] for i in group]), scale, dtype)
        out[rows] = o.to(q.dtype)
    return out


def mla_decode_cpu(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """q_latent [N, H, L + R] over the paged cache [slots, L + R] -> [N, H, L] (q's dtype)."""
    N, H, D = q_latent.shape
    L = kv_lora_rank
    lens = context_lens.long()
    max_len = int(lens.max()) if N else 0
    chunk = chunk or max(block_size, DECODE_CHUNK_ELEMENTS // max(N * D, 1))
    dtype = _acc_dtype(q_latent, cache)
    qf = q_latent.to(dtype) * scale  # [N, H, D]
    b_m = torch.full((N, H, 1), float("-inf"), dtype=dtype)
    b_l = torch.zeros(N, H, 1, dtype=dtype)
    acc = torch.zeros(N, H, L, dtype=dtype)
    tables = block_tables.long()
    for c0 in range(0, max_len, chunk):
        pos = torch.arange(c0, min(c0 + chunk, max_len))  # [C]
        valid = pos[None, :] < lens[:, None]  # [N, C]
        slots = tables[:, pos // block_size] * block_size + pos % block_size
        lat = cache[torch.where(valid, slots, 0)].to(dtype)  # [N, C, D]
        s = torch.bmm(qf, lat.transpose(1, 2)).masked_fill_(~valid[:, None, :], float("-inf"))  # [N, H, C]
        m_new = torch.maximum(b_m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(b_m - m_safe)
        p = torch.exp(s - m_safe)
        b_l = b_l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, lat[..., :L])
        b_m = m_new
    return (acc / b_l.clamp_min(1e-30)).to(q_latent.dtype)


def mla_prefill_paged_chunked(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prior_len: int,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """One sequence's new queries (absorbed) over its paged latents, causal, key-chunked with an
    online softmax so memory is O(Tq * chunk), not O(Tq * context): q_latent [Tq, H, L + R] at
    positions prior_len .. prior_len + Tq - 1 -> [Tq, H, L] (q's dtype). Plain PyTorch, so it
    serves any device; on CPU tensors `mla_prefill_paged_cpu` is the fast path."""
    Tq, H, D = q_latent.shape
    L = kv_lora_rank
    total = prior_len + Tq
    chunk = chunk or max(block_size, DECODE_CHUNK_ELEMENTS // max(Tq * H, 1))
    dtype = _acc_dtype(q_latent, cache)
    qf = (q_latent.to(dtype) * scale).reshape(Tq * H, D)  # [Tq * H, D]
    q_pos = (prior_len + torch.arange(Tq)).repeat_interleave(H)[:, None]  # [Tq * H, 1]
    b_m = torch.full((Tq * H, 1), float("-inf"), dtype=dtype)
    b_l = torch.zeros(Tq * H, 1, dtype=dtype)
    acc = torch.zeros(Tq * H, L, dtype=dtype)
    table = block_table.long()
    for c0 in range(0, total, chunk):
        pos = torch.arange(c0, min(c0 + chunk, total))  # [C]
        lat = cache[table[pos // block_size] * block_size + pos % block_size].to(dtype)  # [C, D]
        s = (qf @ lat.T).masked_fill_(pos[None, :] > q_pos, float("-inf"))  # [Tq * H, C]
        m_new = torch.maximum(b_m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
        alpha = torch.exp(b_m - m_safe)
        p = torch.exp(s - m_safe)
        b_l = b_l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ lat[:, :L]
        b_m = m_new
    return (acc / b_l.clamp_min(1e-30)).view(Tq, H, L).to(q_latent.dtype)


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's CPU flash attention with the key rows as values too (it wants one head size):
    q [1, Hq, Tq, D], k [1, Hq, Tk, D] -> (o [1, Hq, Tq, D], logsumexp [1, Hq, Tq])."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k, 0.0, causal, scale=scale)[:2]
    return o, lse


def mla_prefill_paged_cpu(
    q_latent: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    prior_len: int,
    block_size: int,
    kv_lora_rank: int,
    scale: float,
    chunk: int | None = None,
) -> torch.Tensor:
    """`mla_prefill_paged_chunked` on CPU, 20x faster at long contexts: the prior keys need no
    mask, so each gathered chunk of them is one unmasked flash call over all heads' queries, the
    new keys one causal flash call, and the pieces merge by their logsumexp. Memory is one
    gathered chunk of `chunk` latent rows plus O(Tq * H) -> [Tq, H, L] (q's dtype)."""
    Tq, H, D = q_latent.shape
    chunk = chunk or max(block_size, DECODE_CHUNK_ELEMENTS // D)
    dtype = _acc_dtype(q_latent, cache)
    table = block_table.long()

    def gather(start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return cache[table[pos // block_size] * block_size + pos % block_size].to(dtype)  # [C, D]

    q_heads = q_latent.to(dtype).permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, H, Tq, D]
    new = gather(prior_len, prior_len + Tq)[None, None].expand(1, H, Tq, D)
    o, lse = _flash_cpu(q_heads, new, True, scale)
    o, lse = o.reshape(H * Tq, D), lse.reshape(H * Tq, 1)  # rows are (head, query)
    q_rows = q_heads.view(1, 1, H * Tq, D)  # one shared key head: fold the heads into the rows
    for c0 in range(0, prior_len, chunk):
        o_c, lse_c = _flash_cpu(q_rows, gather(c0, min(c0 + chunk, prior_len))[None, None], False, scale)
        o_c, lse_c = o_c.reshape(H * Tq, D), lse_c.reshape(H * Tq, 1)
        m = torch.maximum(lse, lse_c)
        w, w_c = torch.exp(lse - m), torch.exp(lse_c - m)
        o = (o * w + o_c * w_c) / (w + w_c)
        lse = m + torch.log(w + w_c)
    return o.view(H, Tq, D)[..., :kv_lora_rank].transpose(0, 1).to(q_latent.dtype)
