"""Media inside a request: placeholder spans in the prompt, the encoder input, and (once encoded)
one embedding row per placeholder token.

A request's prompt holds one media placeholder id per item; `attach_media` expands each to the
item's token count. The engine encodes a request's media once, the first time a prefill chunk
reaches one of its placeholders (all pending requests of a step in one encoder call), and keeps the
embeddings until the request ends, so chunked prefill and recompute after preemption read the
same rows. Prefix-cache block hashes include the content hash of every item overlapping a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k3ray.config import VisionConfig
from k3ray.vision import ProcessedMedia, checked_grid, encode_media, expand_placeholders, media_token_count

# (pixel_values [P, 3, p, p], grid_thws [C, 3]) -> [n_tokens, text_hidden]: encode_media over an
# in-process K3VisionModel, or a VisionEncoder actor
VisionEncoderFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(eq=False)  # holds tensors
class PromptMedia:
    spans: tuple[tuple[int, int], ...]  # (start, count) of each item in the expanded prompt
    hashes: tuple[bytes, ...]  # content hash of each item
    items: tuple[ProcessedMedia, ...] | None  # encoder input; dropped once encoded
    embeds: torch.Tensor | None = None  # [sum counts, D] once encoded

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.spans)

    def overlaps(self, start: int, end: int) -> bool:
        return any(s < end and start < s + n for s, n in self.spans)

    def rows_in(self, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """(offsets from `start` of the placeholder tokens in [start, end), their embeddings [M, D])."""
        assert self.embeds is not None, "media not encoded yet"
        offsets: list[int] = []
        parts: list[torch.Tensor] = []
        row = 0
        for s, n in self.spans:
            lo, hi = max(s, start), min(s + n, end)
            if lo < hi:
                offsets += range(lo - start, hi - start)
                parts.append(self.embeds[row + lo - s : row + hi - s])
            row += n
        if not parts:
            return [], self.embeds[:0]
        return offsets, torch.cat(parts)

    def block_key(self, start: int, end: int) -> bytes:
        """What a prefix-cache block over [start, end) adds to its token ids: the content hash and
        relative start of every item overlapping it (b"" for a block without media)."""
        key = b""
        for (s, n), digest in zip(self.spans, self.hashes):
            if s < end and start < s + n:
                key += digest + array("q", [s - start]).tobytes()
        return key

    def set_embeds(self, embeds: torch.Tensor) -> None:
        self.embeds = embeds
        self.items = None


def attach_media(token_ids: Sequence[int], placeholder_id: int, items: Sequence[ProcessedMedia],
                 vision: VisionConfig) -> tuple[list[int], PromptMedia]:
    """Check each item against the tower and expand the k-th placeholder of `token_ids` to item k's
    token count -> (expanded ids, PromptMedia)."""
    for i, item in enumerate(items):
        if not isinstance(item, ProcessedMedia):
            raise ValueError(f"media[{i}] must be a ProcessedMedia (see k3ray.vision.preprocess_media), "
                             f"got {type(item).__name__}")
        try:
            checked_grid(vision, item.pixel_values, item.grid_thws)
            count = media_token_count(item.grid_thws, vision.merge_kernel)
        except ValueError as e:
            raise ValueError(f"media[{i}] does not fit this model's vision tower: {e}") from e
        if count != item.num_tokens:
            raise ValueError(f"media[{i}] says num_tokens={item.num_tokens} but its grid gives {count}")
    expanded = expand_placeholders(token_ids, placeholder_id, [m.num_tokens for m in items])
    hashes = tuple(hashlib.blake2b(m.content_hash.encode(), digest_size=16).digest() for m in items)
    return expanded.token_ids, PromptMedia(expanded.spans, hashes, tuple(items))


def encode_pending(encoder: VisionEncoderFn, pending: Sequence[PromptMedia], hidden_size: int) -> None:
    """Encode every item of `pending` in one encoder call and store each request's rows."""
    items = [m for media in pending for m in media.items]
    pixels = torch.cat([m.pixel_values for m in items])
    grids = torch.cat([m.grid_thws for m in items])
    embeds = encoder(pixels, grids)
    total = sum(media.num_tokens for media in pending)
    if tuple(embeds.shape) != (total, hidden_size):
        raise ValueError(f"the vision encoder returned {tuple(embeds.shape)} for {total} placeholder tokens; "
                         f"expected ({total}, {hidden_size})")
    for media, rows in zip(pending, embeds.split([media.num_tokens for media in pending])):
        media.set_embeds(rows.clone() if len(pending) > 1 else rows)


def local_vision_encoder(model) -> VisionEncoderFn:
    """The encoder callable over an in-process K3VisionModel."""
    def encode(pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        return encode_media(model, pixel_values, grid_thws)

    return encode
