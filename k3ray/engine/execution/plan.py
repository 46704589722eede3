"""What crosses the executor boundary: plain CPU tensors and ints, picklable for a Ray executor
(media embeddings excepted: they stay where the vision encoder left them).

An executor holds the model(s) and the cache pools; the scheduler decides every index. A BatchPlan
goes as is to whatever runs the model (the local executor, each pipeline stage), which reads it
through `forward_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from k3ray.models.forward_batch import ForwardBatch, ModelCache


@dataclass
class BatchPlan:
    """One model forward over N sequences whose new tokens are packed back to back.

    input_ids        [T]      new tokens
    cu_seqlens       [N + 1]  token offsets
    context_lens     [N]      cached + new tokens per sequence
    state_slots      [N]      KDA / conv slot read (if the sequence has cached tokens) and written
    block_tables     [N, B]   MLA blocks per sequence (padding is never read)
    logits_indices   [M]      token rows whose logits are returned
    spec_state_slots [N, Q]   verification: the state after new token j goes to slot [i, j] and
                              state_slots is left as it was (rollback is a slot choice)
    mm_positions     [M]      rows of input_ids that are media placeholders (None: no media)
    mm_embeds        [M, D]   their embeddings, spliced over the token embeddings of those rows
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    state_slots: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    spec_state_slots: torch.Tensor | None = None
    mm_positions: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None

    @property
    def num_logits(self) -> int:
        return self.logits_indices.numel()

    def forward_batch(self, cache: ModelCache) -> ForwardBatch:
        """The model's view of this batch over `cache`, its indices copied to the cache's device
        (once, for every layer)."""
        return ForwardBatch(self.cu_seqlens, self.context_lens, self.state_slots, self.block_tables, cache,
                            self.spec_state_slots)

    def without_media(self) -> BatchPlan:
        """What pipeline stages after the first get: they never read the media rows."""
        return self if self.mm_positions is None else replace(self, mm_positions=None, mm_embeds=None)


@dataclass
class StepPlan:
    """One engine step: state copies (src slot, dst slot) before the forwards (prefix-hit restores)
    and after them (snapshots); returns the logits of every batch, concatenated in order."""

    batches: list[BatchPlan]
    pre_copies: list[tuple[int, int]] = field(default_factory=list)
    post_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class DraftPlan:
    """Greedy drafting with the draft model: feed input_ids (each sequence's last token, at
    position context_lens - 1), then num_drafts times the token just drafted. The state after the
    j-th fed token goes to spec_state_slots[:, j] (j = 0..num_drafts, the last feed is the final
    draft itself), so the draft model's state after any accepted prefix is a slot choice."""

    input_ids: torch.Tensor  # [N]
    context_lens: torch.Tensor  # [N]
    state_slots: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, B]
    spec_state_slots: torch.Tensor  # [N, num_drafts + 1]
    num_drafts: int


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """[N, widest table] int32, zero-padded, built in one call (a tensor per row cost ~0.3 ms a step at 64)."""
    width = max(max((len(t) for t in tables), default=0), 1)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(len(tables), width)
