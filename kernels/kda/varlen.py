"""Index bookkeeping for packed variable-length sequences split into fixed-size chunks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkLayout:
    """Where each token and chunk of a packed batch lives when every sequence is padded to a
    multiple of the chunk size and the chunks are laid back to back.

    seq_of_token  [T]      sequence index of each token
    dest          [T]      row of each token in the padded [NC * C] layout
    num_chunks    [N]      chunks per sequence (ceil(len / C))
    chunk_offsets [N + 1]  first global chunk of each sequence
    chunk_indices [NC, 2]  (sequence, chunk within the sequence) of each global chunk
    """

    seq_of_token: torch.Tensor
    dest: torch.Tensor
    num_chunks: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_indices: torch.Tensor
    total_chunks: int


def chunk_layout(cu_seqlens: torch.Tensor, chunk_size: int) -> ChunkLayout:
    cu = cu_seqlens.long()
    N = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    num_chunks = (lens + chunk_size - 1) // chunk_size
    chunk_offsets = torch.zeros(N + 1, dtype=torch.long, device=cu.device)
    chunk_offsets[1:] = num_chunks.cumsum(0)
    total_chunks = int(chunk_offsets[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(N, device=cu.device), lens, output_size=int(cu[-1]))
    local = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][seq_of_token]
    dest = chunk_offsets[:-1][seq_of_token] * chunk_size + local
    seq_of_chunk = torch.repeat_interleave(torch.arange(N, device=cu.device), num_chunks, output_size=total_chunks)
    chunk_in_seq = torch.arange(total_chunks, device=cu.device) - chunk_offsets[:-1][seq_of_chunk]
    chunk_indices = torch.stack([seq_of_chunk, chunk_in_seq], 1)
    return ChunkLayout(seq_of_token, dest, num_chunks, chunk_offsets, chunk_indices, total_chunks)


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """ValueError unless cu_seqlens is a 1-D non-decreasing offset vector from 0 to num_tokens
    (values are checked for CPU tensors only)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.is_cuda:
        return  # reading the values would synchronise the device
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the {num_tokens} packed tokens, got {first}..{last}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def check_spec_slots(
    cu_seqlens: torch.Tensor, num_tokens: int, initial_slots: torch.Tensor, out_slots: torch.Tensor
) -> None:
    """The speculative-verification layout: check_cu_seqlens, then ValueError unless initial_slots
    is [N] and out_slots [N, Q] has a column for every token of the longest sequence (that count is
    checked for CPU tensors only)."""
    check_cu_seqlens(cu_seqlens, num_tokens)
    N = cu_seqlens.numel() - 1
    if initial_slots.shape != (N,):
        raise ValueError(f"initial_slots must be [{N}], got {list(initial_slots.shape)}")
    if out_slots.dim() != 2 or out_slots.shape[0] != N:
        raise ValueError(f"out_slots must be [{N}, max q_len], got {list(out_slots.shape)}")
    if cu_seqlens.is_cuda or cu_seqlens.numel() < 2:
        return
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if out_slots.shape[1] < max_len:
        raise ValueError(f"out_slots needs >= {max_len} columns (the longest q_len), got {list(out_slots.shape)}")
