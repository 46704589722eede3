"""What one model step needs besides token ids: where each sequence's state and latent cache live.

The caller (the engine's scheduler, or `k3ray.api` for single sequences) owns the pools and the
indices; the model only reads and writes where it is told. No module globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3ray.config import ModelConfig


@dataclass
class ModelCache:
    """State pools, keyed by absolute layer index (a pipeline stage holds only its layers).

    kda_state[l]   [S, H, K, V] fp32   recurrent state per slot
    conv_state[l]  [S, 3 * H * K, W - 1] short-conv windows (q | k | v channels)
    mla_latent[l]  [num_blocks * block_size, kv_lora_rank + qk_rope_head_dim]
    """

    kda_state: dict[int, torch.Tensor]
    conv_state: dict[int, torch.Tensor]
    mla_latent: dict[int, torch.Tensor]
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_state_slots: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layers: range | None = None,
    ) -> "ModelCache":
        layers = range(config.num_layers) if layers is None else layers
        H, K, W = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        kda, conv, mla = {}, {}, {}
        for l in layers:
            if config.layer_types[l] == "kda":
                kda[l] = torch.zeros(num_state_slots, H, K, K, dtype=torch.float32, device=device)
                conv[l] = torch.zeros(num_state_slots, 3 * H * K, W - 1, dtype=dtype, device=device)
            else:
                mla[l] = torch.zeros(num_blocks * block_size, config.mla_latent_dim, dtype=dtype, device=device)
        return cls(kda, conv, mla, block_size)

    def copy_states(self, src_slots: torch.Tensor | list[int], dst_slots: torch.Tensor | list[int]) -> None:
        """Copy the KDA and conv state of slot src_slots[i] into dst_slots[i] in every layer held
        (prefix-cache snapshots and restores, speculative drafting). All reads happen before writes."""
        src, dst = torch.as_tensor(src_slots).long(), torch.as_tensor(dst_slots).long()
        for pool in (*self.kda_state.values(), *self.conv_state.values()):
            pool[dst] = pool[src]

    def nbytes(self) -> dict[str, int]:
        def total(d: dict[int, torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in d.values())

        return {"kda_state": total(self.kda_state), "conv_state": total(self.conv_state), "mla_latent": total(self.mla_latent)}


@dataclass
class ForwardBatch:
    """Per-step metadata for N sequences whose new tokens are packed back to back.

    cu_seqlens    [N + 1]  new-token offsets
    context_lens  [N]      tokens in each context after this step (cached + new)
    state_slots   [N]      KDA / conv slot of each sequence
    block_tables  [N, B]   MLA cache blocks of each sequence
    spec_state_slots [N, q] optional: write the KDA / conv state after every new token to its own
                           slot (speculative verification; rollback is a slot choice)
    """

    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    state_slots: torch.Tensor
    block_tables: torch.Tensor
    cache: ModelCache
    spec_state_slots: torch.Tensor | None = None
    # derived in __post_init__
    q_lens: torch.Tensor = field(init=False)
    prior_lens: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    slot_mapping: torch.Tensor = field(init=False)
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.cu_seqlens = self.cu_seqlens.long()
        self.context_lens = self.context_lens.long()
        self.q_lens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        self.prior_lens = self.context_lens - self.q_lens
        assert bool((self.prior_lens >= 0).all()), "context_lens must include the new tokens"
        seq_of_token = torch.repeat_interleave(torch.arange(self.q_lens.numel()), self.q_lens)
        self.positions = self.prior_lens[seq_of_token] + (
            torch.arange(int(self.cu_seqlens[-1])) - self.cu_seqlens[:-1][seq_of_token]
        )
        bs = self.cache.block_size
        if self.block_tables.numel():
            blocks = self.block_tables.long()[seq_of_token, self.positions // bs]
            self.slot_mapping = blocks * bs + self.positions % bs
        else:
            self.slot_mapping = torch.zeros(0, dtype=torch.long)
        self.is_decode = bool((self.q_lens == 1).all() and (self.prior_lens > 0).all())

    def decode_split(self) -> DecodeSplit | None:
        """A step mixing decodes (one new token after a cached prefix) with prefill chunks, as two
        sub-batches, so the decodes take the decode kernels; None if the step is not mixed (or is a
        speculative verification, whose per-token states the split would not keep)."""
        if self.is_decode or self.spec_state_slots is not None:
            return None
        if not hasattr(self, "_decode_split"):
            self._decode_split = self._split_decodes()
        return self._decode_split

    def _split_decodes(self) -> DecodeSplit | None:
        is_decode = (self.q_lens == 1) & (self.prior_lens > 0)  # [N]
        if not bool(is_decode.any()):
            return None
        token_is_decode = torch.repeat_interleave(is_decode, self.q_lens)  # [T]

        def part(seqs: torch.Tensor) -> ForwardBatch:
            cu = torch.cat([torch.zeros(1, dtype=torch.long), self.q_lens[seqs].cumsum(0)])
            return ForwardBatch(cu, self.context_lens[seqs], self.state_slots[seqs], self.block_tables[seqs],
                                self.cache)

        return DecodeSplit(part(is_decode), token_is_decode.nonzero().squeeze(1),
                           part(~is_decode), (~token_is_decode).nonzero().squeeze(1))

    @property
    def num_seqs(self) -> int:
        return self.q_lens.numel()

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


@dataclass(frozen=True)
class DecodeSplit:
    """A mixed step's sequences in two sub-batches (same cache) and the rows of their tokens."""

    decode: ForwardBatch
    decode_rows: torch.Tensor  # [T_decode] token rows of the step
    prefill: ForwardBatch
    prefill_rows: torch.Tensor  # [T_prefill]
