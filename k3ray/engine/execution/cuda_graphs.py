"""CUDA graphs for decode steps, captured the way vLLM and SGLang do it: one graph per batch-size
bucket over static inputs (token ids, context lengths, state slots, cache slots, block tables) that
each step fills with one host-to-device copy, a batch padded up to its bucket. Padding rows use
state slot -1 (start from zeros, store nothing) and write their latent to real row 0's cache slot
with row 0's value, so they change nothing. Mixed, prefill, verification and media steps stay eager.
"""

from __future__ import annotations

import torch

from k3ray.engine.execution.plan import BatchPlan
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.k3 import K3ForCausalLM

FIELDS = 5  # ids, context_lens, state_slots, slot_mapping, latent_rows: [B] each, then block tables [B, W]


def decode_batch_sizes(max_batch: int) -> list[int]:
    """The captured buckets: 1, 2, 4, then every multiple of 8, up to and including max_batch."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    return small + [b for b in range(8, max_batch, 8)] + [max_batch]


class DecodeInputs:
    """A decode batch of up to max_batch sequences (max_blocks blocks each) in one int64 buffer:
    ids, context_lens, state_slots, slot_mapping, latent_rows [B] each, then block_tables [B, W]."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, pin: bool = False) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.buffer = torch.zeros(FIELDS * max_batch + max_batch * max_blocks, dtype=torch.long, device=device)
        if pin:
            self.buffer = self.buffer.pin_memory()
        B = max_batch
        self.ids, self.context_lens, self.state_slots, self.slot_mapping, self.latent_rows = (
            self.buffer[: FIELDS * B].view(FIELDS, B).unbind(0))
        self.block_tables = self.buffer[FIELDS * B :].view(B, max_blocks)
        self.cu_seqlens = torch.arange(B + 1, device=device)

    def used(self, size: int) -> int:
        """Buffer elements a batch of `size` rows reads (the block-table rows past it are left alone)."""
        return FIELDS * self.max_batch + size * self.max_blocks

    def fill(self, plan: BatchPlan, size: int, block_size: int) -> None:
        """Write plan's n sequences, padded to `size` rows: padding rows hold token 0 at context 1,
        state slot -1, and write real row 0's latent to row 0's cache slot."""
        n, w = plan.context_lens.numel(), plan.block_tables.shape[1]
        self.ids[:n], self.context_lens[:n], self.state_slots[:n] = plan.input_ids, plan.context_lens, plan.state_slots
        self.block_tables[:n, :w] = plan.block_tables
        last = self.context_lens[:n] - 1
        blocks = self.block_tables[:n].gather(1, (last // block_size)[:, None])[:, 0]
        self.slot_mapping[:n] = blocks * block_size + last % block_size
        self.latent_rows[:n] = torch.arange(n)
        self.ids[n:size], self.context_lens[n:size], self.state_slots[n:size] = 0, 1, -1
        self.block_tables[n:size, 0] = 0
        self.slot_mapping[n:size], self.latent_rows[n:size] = self.slot_mapping[0], 0

    def forward_batch(self, n: int, cache: ModelCache) -> ForwardBatch:
        """The first n rows as the model's decode batch (views: later fills show through)."""
        return ForwardBatch.decode_on_device(self.state_slots[:n], self.context_lens[:n], self.block_tables[:n],
                                             self.slot_mapping[:n], self.latent_rows[:n], self.cu_seqlens[: n + 1],
                                             cache)


class DecodeGraphs:
    """Captured decode forwards of `model` over `cache` for batches of up to max_batch sequences,
    each holding at most max_blocks blocks. Capture writes a stray latent into cache row 0, so it
    must happen before the cache holds anything."""

    def __init__(self, model: K3ForCausalLM, cache: ModelCache, max_batch: int, max_blocks: int) -> None:
        assert cache.device.type == "cuda", "CUDA graphs need a CUDA cache"
        self.model, self.cache = model, cache
        self.sizes = decode_batch_sizes(max_batch)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.host = DecodeInputs(max_batch, max_blocks, torch.device("cpu"), pin=True)
        self.inputs = DecodeInputs(max_batch, max_blocks, cache.device)
        self.copied = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self._capture_all()

    def _forward(self, n: int) -> torch.Tensor:
        return self.model(self.inputs.ids[:n], self.inputs.forward_batch(n, self.cache)).float()  # [n, V]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        self.inputs.context_lens.fill_(1)
        self.inputs.state_slots.fill_(-1)
        pool = None
        for n in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels and warms cuBLAS outside the capture
                    self._forward(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def fits(self, plan: BatchPlan) -> bool:
        """Whether plan is a plain decode step (one token after a cached prefix per sequence, every
        row's logits, no drafts or media) within the captured sizes."""
        n = plan.context_lens.numel()
        return (plan.spec_state_slots is None and plan.mm_positions is None and 0 < n <= self.max_batch
                and plan.input_ids.numel() == n and plan.block_tables.shape[1] <= self.max_blocks
                and torch.equal(plan.cu_seqlens.long(), torch.arange(n + 1))
                and bool((plan.context_lens > 1).all()) and torch.equal(plan.logits_indices.long(), torch.arange(n)))

    def run(self, plan: BatchPlan) -> torch.Tensor:
        """Replay the bucket that holds plan's batch -> fp32 logits [n, V], valid until the next run."""
        n = plan.context_lens.numel()
        size = next(s for s in self.sizes if s >= n)
        self.copied.synchronize()  # the previous step's copy has left the pinned buffer
        self.host.fill(plan, size, self.cache.block_size)
        used = self.host.used(size)
        self.inputs.buffer[:used].copy_(self.host.buffer[:used], non_blocking=True)
        self.copied.record()
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:n]
