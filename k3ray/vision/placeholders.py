"""Media placeholders in token-id prompts: how many tokens each media item takes, expanding each
single placeholder id to that many, and splicing the encoder's embeddings into the text embeddings.

The chat template emits one `<|kimi_image_placeholder|>` per image or video; the vision path turns
it into one placeholder id per merged token (`media_token_count`), so the prompt length and the
encoder output agree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def media_token_count(grid_thws: torch.Tensor | Sequence, merge_kernel: tuple[int, int] = (2, 2)) -> int:
    """Tokens one media item yields: sum over its chunks of (h/kh)*(w/kw) (frames are mean-pooled)."""
    kh, kw = merge_kernel
    total = 0
    for t, h, w in torch.as_tensor(grid_thws).reshape(-1, 3).tolist():
        if t <= 0 or h <= 0 or w <= 0 or h % kh or w % kw:
            raise ValueError(f"grid ({t}, {h}, {w}) is not a valid chunk for merge kernel {merge_kernel}")
        total += (h // kh) * (w // kw)
    return total


@dataclass(frozen=True, eq=False)  # holds a tensor
class ExpandedPrompt:
    token_ids: list[int]
    positions: torch.Tensor  # [sum counts] int64: where the media embeddings go, items in order
    spans: tuple[tuple[int, int], ...]  # (start, count) of each media item in token_ids


def expand_placeholders(token_ids: Sequence[int], placeholder_id: int, token_counts: Sequence[int]) -> ExpandedPrompt:
    """Replace the k-th occurrence of `placeholder_id` with token_counts[k] copies of it."""
    found = sum(1 for tok in token_ids if tok == placeholder_id)
    if found != len(token_counts):
        raise ValueError(
            f"prompt holds {found} media placeholder token(s) (id {placeholder_id}) "
            f"but {len(token_counts)} media item(s) were given"
        )
    bad = [n for n in token_counts if not isinstance(n, int) or isinstance(n, bool) or n <= 0]
    if bad:
        raise ValueError(f"token_counts must be positive ints, got {bad[:3]}")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    item = 0
    for tok in token_ids:
        if tok == placeholder_id:
            spans.append((len(out), token_counts[item]))
            out.extend([placeholder_id] * token_counts[item])
            item += 1
        else:
            out.append(tok)
    positions = torch.cat([torch.arange(s, s + n) for s, n in spans]) if spans else torch.empty(0, dtype=torch.long)
    return ExpandedPrompt(out, positions, tuple(spans))


def splice_media_embeddings(
    text_embeds: torch.Tensor, positions: torch.Tensor, media_embeds: torch.Tensor
) -> torch.Tensor:
    """text_embeds [T, D] with rows `positions` [M] replaced by media_embeds [M, D] (a new tensor)."""
    if text_embeds.dim() != 2 or media_embeds.dim() != 2 or positions.dim() != 1:
        raise ValueError(
            f"expected text_embeds [T, D], positions [M], media_embeds [M, D]; got {tuple(text_embeds.shape)}, "
            f"{tuple(positions.shape)}, {tuple(media_embeds.shape)}"
        )
    if media_embeds.shape[0] != positions.shape[0]:
        raise ValueError(f"{positions.shape[0]} placeholder positions but {media_embeds.shape[0]} media embeddings")
    if media_embeds.shape[1] != text_embeds.shape[1]:
        raise ValueError(f"media embedding width {media_embeds.shape[1]} != text hidden size {text_embeds.shape[1]}")
    if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < text_embeds.shape[0]):
        raise ValueError(f"placeholder positions must lie in [0, {text_embeds.shape[0]})")
    if positions.unique().numel() != positions.numel():
        raise ValueError("placeholder positions must be distinct")
    return text_embeds.index_copy(0, positions.to(text_embeds.device), media_embeds.to(text_embeds.dtype))
