"""Logits -> tokens: greedy, or temperature / top-k / top-p / min-p sampling from a per-sequence
generator (one uniform draw per token, so a seeded sequence samples the same tokens whatever else
shares its batch), and log-probabilities from the raw fp32 log-softmax."""

from __future__ import annotations

import torch

from k3ray.engine.outputs import Logprob, PositionLogprobs
from k3ray.sampling_params import SamplingParams


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are drawn from: fp32 probs [..., V] after
    temperature, top-k, top-p and min-p (greedy params give the one-hot argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits / params.temperature
    if params.top_k != -1 and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, -1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(-1, descending=True)
        p = sorted_x.softmax(-1)
        drop_sorted = (p.cumsum(-1) - p) >= params.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = x.softmax(-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] by inverse CDF with a single uniform draw."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_max(probs.numel() - 1))


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [M, V] -> one token per row."""
    if logits.shape[0] == 0:
        return []
    argmax = logits.argmax(-1).tolist()
    return [
        argmax[i] if p.greedy else draw(sampling_probs(logits[i], p), g)
        for i, (p, g) in enumerate(zip(params, generators))
    ]


def logprob_entries(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[PositionLogprobs]:
    """For each row of logits [M, V]: the top num_top tokens and tokens[i], with log-prob and rank."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(-1, torch.tensor(tokens)[:, None])
    ranks = ((logp > chosen).sum(-1) + 1).tolist()
    top = logp.topk(num_top, -1) if num_top else None
    out = []
    for i, tok in enumerate(tokens):
        entry: PositionLogprobs = {}
        if top is not None:
            for r, (v, t) in enumerate(zip(top.values[i].tolist(), top.indices[i].tolist())):
                entry[t] = Logprob(v, r + 1)
        entry[tok] = Logprob(float(chosen[i, 0]), ranks[i])
        out.append(entry)
    return out
