"""The logits controls of SamplingParams, applied to a step's rows before sampling, as vLLM defines
them: logit_bias added first, then repetition_penalty over the prompt and output tokens (a positive
logit divided by it, a negative one multiplied), then frequency_penalty x the token's count in the
output and presence_penalty once it is there subtracted. Batched over the rows that ask for them,
on the logits' device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3ray.sampling_params import SamplingParams


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: Sequence[Sequence[int]],
                   prompt_lens: Sequence[int]) -> torch.Tensor:
    """logits [M, V] (row i: params[i]; token_ids[i] its prompt, the first prompt_lens[i] ids, then
    its output so far) -> fp32 logits [M, V] with each row's logit_bias and penalties applied; rows
    that ask for none are unchanged."""
    logits = logits.float().clone()
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if biased:
        _add_logit_bias(logits, biased, [params[i].logit_bias for i in biased])
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        logits[penalised] = apply_penalties(
            logits[penalised], [params[i] for i in penalised], [token_ids[i][: prompt_lens[i]] for i in penalised],
            [token_ids[i][prompt_lens[i]:] for i in penalised])
    return logits


def _add_logit_bias(logits: torch.Tensor, rows: list[int], biases: list[dict[int, float]]) -> None:
    row_index = [r for r, bias in zip(rows, biases) for _ in bias]
    token_index = [t for bias in biases for t in bias]
    values = [v for bias in biases for v in bias.values()]
    device = logits.device
    logits.index_put_((torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)),
                      torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [M, V] fp32 -> logits [M, V] with every row's repetition, frequency and presence penalty."""
    M, V = logits.shape
    device = logits.device
    output_counts = token_counts(output_ids, V, device)  # [M, V]
    if any(p.repetition_penalty != 1.0 for p in params):
        # only the repetition penalty reads the prompt (one pass over its ids per step)
        repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
        seen = (token_counts(prompt_ids, V, device) > 0) | (output_counts > 0)  # [M, V]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    return logits - frequency * output_counts - presence * (output_counts > 0).to(logits.dtype)


def token_counts(ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row of ids: fp32 [len(ids), vocab_size]."""
    counts = torch.zeros(len(ids), vocab_size, device=device)
    lengths = [len(row) for row in ids]
    if sum(lengths):
        rows = torch.repeat_interleave(torch.arange(len(ids), device=device), torch.tensor(lengths, device=device))
        tokens = torch.tensor([t for row in ids for t in row], device=device)
        counts.index_put_((rows, tokens), torch.ones(len(tokens), device=device), accumulate=True)
    return counts
