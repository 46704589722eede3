"""CUDA graphs for decode steps, captured the way vLLM and SGLang do it: one graph per batch-size
bucket over static inputs (token ids, context lengths, state slots, cache slots, block tables) that
each step fills with one host-to-device copy, a batch padded up to its bucket. Padding rows use
state slot -1 (start from zeros, store nothing) and write their latent to real row 0's cache slot
with row 0's value, so they change nothing. Mixed, prefill, verification and media steps stay eager.
"""

from __future__ import annotations

import torch

from k3ray.engine.plan import BatchPlan
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.k3 import K3ForCausalLM

FIELDS = 5  # ids, context_lens, state_slots, slot_mapping, latent_rows: [B] each, then block tables [B, W]


def decode_batch_sizes(max_batch: int) -> list[int]:
    """The captured buckets: 1, 2, 4, then every multiple of 8, up to and including max_batch."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    return small + [b for b in range(8, max_batch, 8)] + [max_batch]


class DecodeGraphs:
    """Captured decode forwards of `model` over `cache` for batches of up to max_batch sequences,
    each holding at most max_blocks blocks. Capture writes a stray latent into cache row 0, so it
    must happen before the cache holds anything."""

    def __init__(self, model: K3ForCausalLM, cache: ModelCache, max_batch: int, max_blocks: int) -> None:
        assert cache.device.type == "cuda", "CUDA graphs need a CUDA cache"
        self.model, self.cache = model, cache
        self.sizes = decode_batch_sizes(max_batch)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        B, W = max_batch, max_blocks
        self.host = torch.zeros(FIELDS * B + B * W, dtype=torch.long).pin_memory()
        self.inputs = torch.zeros_like(self.host, device=cache.device)
        self.cu_seqlens = torch.arange(B + 1, device=cache.device)
        self.copied = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _fields(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(ids, context_lens, state_slots, slot_mapping, latent_rows, block_tables [B, W]) views of t."""
        B = self.max_batch
        return (*t[: FIELDS * B].view(FIELDS, B).unbind(0), t[FIELDS * B :].view(B, self.max_blocks))

    def _forward(self, n: int) -> torch.Tensor:
        ids, ctx, slots, slot_mapping, latent_rows, tables = self._fields(self.inputs)
        batch = ForwardBatch.decode_on_device(slots[:n], ctx[:n], tables[:n], slot_mapping[:n], latent_rows[:n],
                                              self.cu_seqlens[: n + 1], self.cache)
        return self.model(ids[:n], batch).float()  # [n, V]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        ids, ctx, slots, slot_mapping, latent_rows, tables = self._fields(self.inputs)
        ctx.fill_(1)
        slots.fill_(-1)
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
        ids, ctx, slots, slot_mapping, latent_rows, tables = self._fields(self.host)
        w = plan.block_tables.shape[1]
        ids[:n], ctx[:n], slots[:n] = plan.input_ids, plan.context_lens, plan.state_slots
        tables[:n, :w] = plan.block_tables
        last = ctx[:n] - 1
        bs = self.cache.block_size
        slot_mapping[:n] = tables[:n].gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
        latent_rows[:n] = torch.arange(n)
        ids[n:size], ctx[n:size], slots[n:size], tables[n:size, 0] = 0, 1, -1, 0
        slot_mapping[n:size], latent_rows[n:size] = slot_mapping[0], 0
        used = FIELDS * self.max_batch + size * self.max_blocks  # the block-table rows past `size` stay as they are
        self.inputs[:used].copy_(self.host[:used], non_blocking=True)
        self.copied.record()
        self.graphs[size].replay()
        return self.outputs[size][:n]
