"""What the PyTorch MLA paths share: their accumulation dtype, the size of one gathered chunk of
latents, and the online softmax that folds key chunks into one attention output."""

from __future__ import annotations

import torch

DECODE_CHUNK_ELEMENTS = 1 << 24  # gathered latent values per chunk (64 MiB in fp32)


def accumulation_dtype(*ts: torch.Tensor) -> torch.dtype:
    """fp32 math (fp64 for fp64 inputs), like the naive reference."""
    dtype = torch.float32
    for t in ts:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class OnlineSoftmax:
    """softmax(scores) @ values over keys that arrive chunk by chunk, for rows of any batch shape:
    the running max, sum and weighted values rescale as each chunk's scores come in."""

    def __init__(self, rows: tuple[int, ...], width: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.max = torch.full((*rows, 1), float("-inf"), dtype=dtype, device=device)
        self.sum = torch.zeros(*rows, 1, dtype=dtype, device=device)
        self.acc = torch.zeros(*rows, width, dtype=dtype, device=device)

    def add(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """scores [*rows, C] (-inf where masked), values [*rows-batch, C, width] of one key chunk."""
        m_new = torch.maximum(self.max, scores.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows with no key yet
        alpha = torch.exp(self.max - m_safe)
        p = torch.exp(scores - m_safe)
        self.sum = self.sum * alpha + p.sum(-1, keepdim=True)
        self.acc = self.acc * alpha + p @ values
        self.max = m_new

    def result(self) -> torch.Tensor:
        """[*rows, width] in the accumulation dtype (0 for rows that saw no key)."""
        return self.acc / self.sum.clamp_min(1e-30)
