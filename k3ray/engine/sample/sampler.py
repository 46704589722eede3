"""Logits -> tokens on the logits' device: greedy, or temperature / top-k / top-p / min-p sampling
with one uniform draw per token from the sequence's own CPU generator (so a seeded sequence samples
the same tokens whatever else shares its batch, on any device), and log-probabilities from the raw
fp32 log-softmax. Only the chosen ids and the asked-for log-probabilities come back to the host."""

from __future__ import annotations

import hashlib
import random

import torch

from k3ray.engine.outputs import Logprob, PositionLogprobs
from k3ray.sampling_params import SamplingParams


def sequence_generator(rng: random.Random, seed: int | None, index: int) -> torch.Generator:
    """The random stream of a request's sequence `index`: from its seed (the sequences after the first
    from a hash of seed and index, so n > 1 differ), else from the engine's own rng."""
    if seed is None:
        seed = rng.getrandbits(63)
    elif index:
        seed = int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little") >> 1
    return torch.Generator().manual_seed(seed)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are drawn from: fp32 probs [..., V] after
    temperature, then min-p (against the whole tempered distribution), top-k and top-p, vLLM's
    order (greedy params give the one-hot argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits / params.temperature
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_k != -1 and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, -1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(-1, descending=True)
        p = sorted_x.softmax(-1)
        drop_sorted = (p.cumsum(-1) - p) >= params.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows of probs [M, V] by inverse CDF, row i at the uniform u[i] (float64 [M] on probs' device)
    -> ids [M] int64 on the device."""
    cdf = probs.double().cumsum(-1)
    target = u * cdf[:, -1]
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_max(probs.shape[-1] - 1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] by inverse CDF with a single uniform draw."""
    u = torch.tensor([uniform(generator)], dtype=torch.float64).to(probs.device)
    return int(draw_rows(probs[None], u)[0])


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [M, V] -> one token per row, int64 [M] on the logits' device. Rows with the same
    sampling settings are filtered together; each sampled row draws its uniform from its generator
    on the host, in row order (all of them cross in one copy)."""
    out = logits.argmax(-1)
    groups: dict[tuple, list[int]] = {}
    draw_at: dict[int, int] = {}  # row -> its uniform
    u: list[float] = []
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
            draw_at[i] = len(u)
            u.append(uniform(g))
    if not groups:
        return out
    u_dev = torch.tensor(u, dtype=torch.float64).to(logits.device)
    for rows in groups.values():
        at = torch.tensor(rows).to(logits.device)
        probs = sampling_probs(logits[at], params[rows[0]])
        out[at] = draw_rows(probs, u_dev[torch.tensor([draw_at[i] for i in rows]).to(logits.device)])
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [M, V] -> one token per row (one copy back to the host)."""
    if logits.shape[0] == 0:
        return []
    return sample_tokens(logits, params, generators).tolist()


def logprob_entries(logits: torch.Tensor, tokens: list[int] | torch.Tensor, num_top: int) -> list[PositionLogprobs]:
    """For each row of logits [M, V]: the top num_top tokens and tokens[i], with log-prob and rank
    (worked out on the logits' device; one copy back)."""
    M = logits.shape[0]
    logp = torch.log_softmax(logits.float(), -1)
    tok = torch.as_tensor(tokens, dtype=torch.long).to(logp.device)
    chosen = logp.gather(-1, tok[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(-1) + 1
    parts = [tok, chosen, ranks]
    if num_top:
        top = logp.topk(num_top, -1)
        parts += [top.values.reshape(-1), top.indices.reshape(-1)]
    host = torch.cat([t.double() for t in parts]).cpu()  # ids and ranks are exact in float64
    tok_h, chosen_h, ranks_h = (host[i * M : (i + 1) * M].tolist() for i in range(3))
    top_v, top_i = host[3 * M : 3 * M + M * num_top].tolist(), host[3 * M + M * num_top :].tolist()
    out = []
    for i in range(M):
        entry: PositionLogprobs = {}
        for r in range(num_top):
            entry[int(top_i[i * num_top + r])] = Logprob(top_v[i * num_top + r], r + 1)
        entry[int(tok_h[i])] = Logprob(chosen_h[i], int(ranks_h[i]))
        out.append(entry)
    return out
