"""What one model step needs besides token ids: where each sequence's state and latent cache live.

The caller (the engine's scheduler, or `k3ray.api` for single sequences) owns the pools and the
indices; the model only reads and writes where it is told. No module globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3ray.config import ModelConfig
from k3ray.device import to_device


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

    @property
    def device(self) -> torch.device:
        """Where the pools live (the CPU for a cache that holds none)."""
        pools = (*self.kda_state.values(), *self.mla_latent.values())
        return pools[0].device if pools else torch.device("cpu")

    def copy_states(self, src_slots: torch.Tensor | list[int], dst_slots: torch.Tensor | list[int]) -> None:
        """Copy the KDA and conv state of slot src_slots[i] into dst_slots[i] in every layer held
        (prefix-cache snapshots and restores, speculative drafting). All reads happen before writes."""
        device = self.device
        src, dst = torch.as_tensor(src_slots, device=device).long(), torch.as_tensor(dst_slots, device=device).long()
        for pool in (*self.kda_state.values(), *self.conv_state.values()):
            pool[dst] = pool[src]

    def nbytes(self) -> dict[str, int]:
        def total(d: dict[int, torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in d.values())

        return {"kda_state": total(self.kda_state), "conv_state": total(self.conv_state), "mla_latent": total(self.mla_latent)}


@dataclass
class ForwardBatch:
    """Per-step metadata for N sequences whose new tokens are packed back to back.

    Built from host (CPU) index tensors: what the model branches on is worked out on the host, and
    every index goes to the cache's device in one copy, so no layer reads a value back.

    cu_seqlens    [N + 1]  new-token offsets
    context_lens  [N]      tokens in each context after this step (cached + new)
    state_slots   [N]      KDA / conv slot of each sequence (< 0: start from zeros, store nothing)
    block_tables  [N, B]   MLA cache blocks of each sequence
    spec_state_slots [N, q] optional: write the KDA / conv state after every new token to its own
                           slot (speculative verification; rollback is a slot choice)
    latent_rows   [T]      optional: row of the new latent each token's cache slot receives (padded
                           decode graphs point padding rows at a real row's slot and value)
    """

    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    state_slots: torch.Tensor
    block_tables: torch.Tensor
    cache: ModelCache
    spec_state_slots: torch.Tensor | None = None
    # derived in __post_init__, on the cache's device
    q_lens: torch.Tensor = field(init=False)
    prior_lens: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    slot_mapping: torch.Tensor = field(init=False)
    latent_rows: torch.Tensor | None = field(init=False, default=None)
    # derived on the host
    is_decode: bool = field(init=False)
    num_tokens: int = field(init=False)
    host_cu_seqlens: list[int] = field(init=False)
    host_context_lens: list[int] = field(init=False)
    host_state_slots: torch.Tensor | None = field(init=False)  # [N] int64 on the CPU
    host_block_tables: torch.Tensor | None = field(init=False)  # [N, B] int64 on the CPU

    def __post_init__(self) -> None:
        cu, ctx = self.cu_seqlens.cpu().long(), self.context_lens.cpu().long()
        slots, tables = self.state_slots.cpu().long(), self.block_tables.cpu().long()
        q_lens = cu[1:] - cu[:-1]
        prior_lens = ctx - q_lens
        assert bool((prior_lens >= 0).all()), "context_lens must include the new tokens"
        seq_of_token = torch.repeat_interleave(torch.arange(q_lens.numel()), q_lens)
        positions = prior_lens[seq_of_token] + (torch.arange(int(cu[-1])) - cu[:-1][seq_of_token])
        bs = self.cache.block_size
        if tables.numel():
            slot_mapping = tables[seq_of_token, positions // bs] * bs + positions % bs
        else:
            slot_mapping = torch.zeros(0, dtype=torch.long)
        self.is_decode = bool((q_lens == 1).all() and (prior_lens > 0).all())
        self.num_tokens = int(cu[-1])
        self.host_cu_seqlens, self.host_context_lens = cu.tolist(), ctx.tolist()
        host = [cu, ctx, slots, tables, q_lens, prior_lens, positions, slot_mapping]
        if self.spec_state_slots is not None:
            host.append(self.spec_state_slots.cpu())
        moved = to_device(host, self.cache.device)
        (self.cu_seqlens, self.context_lens, self.state_slots, self.block_tables, self.q_lens, self.prior_lens,
         self.positions, self.slot_mapping) = moved[:8]
        if self.spec_state_slots is not None:
            self.spec_state_slots = moved[8]
        self.host_state_slots, self.host_block_tables = slots, tables
        self._derived: dict = {}

    @classmethod
    def decode_on_device(cls, input_slots: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                         slot_mapping: torch.Tensor, latent_rows: torch.Tensor, cu_seqlens: torch.Tensor,
                         cache: ModelCache) -> ForwardBatch:
        """A decode step over tensors already on the cache's device (a CUDA graph's static inputs):
        one token per sequence after a cached prefix; nothing is computed or copied here."""
        batch = cls.__new__(cls)
        n = context_lens.numel()
        batch.cu_seqlens, batch.context_lens, batch.state_slots = cu_seqlens, context_lens, input_slots
        batch.block_tables, batch.cache, batch.spec_state_slots = block_tables, cache, None
        batch.q_lens = torch.ones_like(context_lens)
        batch.prior_lens, batch.positions = context_lens - 1, context_lens - 1
        batch.slot_mapping, batch.latent_rows = slot_mapping, latent_rows
        batch.is_decode, batch.num_tokens = True, n
        batch.host_cu_seqlens, batch.host_context_lens = list(range(n + 1)), []  # lengths live on the device
        batch.host_state_slots = batch.host_block_tables = None
        batch._derived = {}
        return batch

    def derived(self, key, build):
        """build(), computed once per batch under `key` (per-step index tensors every layer reuses)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def decode_split(self) -> DecodeSplit | None:
        """A step mixing decodes (one new token after a cached prefix) with prefill chunks, as two
        sub-batches, so the decodes take the decode kernels; None if the step is not mixed (or is a
        speculative verification, whose per-token states the split would not keep)."""
        if self.is_decode or self.spec_state_slots is not None:
            return None
        return self.derived("decode_split", self._split_decodes)

    def _split_decodes(self) -> DecodeSplit | None:
        cu, ctx = torch.tensor(self.host_cu_seqlens), torch.tensor(self.host_context_lens)
        q_lens = cu[1:] - cu[:-1]
        is_decode = (q_lens == 1) & (ctx - q_lens > 0)  # [N]
        if not bool(is_decode.any()):
            return None
        token_is_decode = torch.repeat_interleave(is_decode, q_lens)  # [T]
        slots, tables = self.host_state_slots, self.host_block_tables

        def part(seqs: torch.Tensor) -> ForwardBatch:
            part_cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens[seqs].cumsum(0)])
            return ForwardBatch(part_cu, ctx[seqs], slots[seqs], tables[seqs], self.cache)

        decode_rows, prefill_rows = to_device(
            [token_is_decode.nonzero().squeeze(1), (~token_is_decode).nonzero().squeeze(1)], self.cache.device)
        return DecodeSplit(part(is_decode), decode_rows, part(~is_decode), prefill_rows)

    @property
    def num_seqs(self) -> int:
        return len(self.host_cu_seqlens) - 1


@dataclass(frozen=True)
class DecodeSplit:
    """A mixed step's sequences in two sub-batches (same cache) and the rows of their tokens."""

    decode: ForwardBatch
    decode_rows: torch.Tensor  # [T_decode] token rows of the step
    prefill: ForwardBatch
    prefill_rows: torch.Tensor  # [T_prefill]
