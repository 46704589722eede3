"""Executors run StepPlans on a model. `LocalExecutor` holds the model in this process; the Ray
executor (k3ray.actors) implements the same interface over pipeline-stage actors. Besides
stepping, every executor answers `health()` and `shutdown()`, so a server asks them of any."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod

import torch

from k3ray.device import to_device
from k3ray.engine.core.cache_manager import CacheGeometry, CacheLayout
from k3ray.engine.execution.cuda_graphs import DecodeGraphs
from k3ray.engine.disagg.handoff import (
    CacheRecord,
    HandoffMismatchError,
    RemoteCacheRecord,
    local_record,
    read_record,
    write_record,
)
from k3ray.engine.execution.plan import BatchPlan, DraftPlan, StepPlan
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.k3 import K3ForCausalLM
from k3ray.vision.placeholders import splice_media_embeddings


class Executor(ABC):
    @abstractmethod
    def cache_layout(self) -> CacheLayout:
        """(config, cache dtype) of the target model, then of the draft model if there is one."""

    @abstractmethod
    def allocate_cache(self, geometry: CacheGeometry) -> None:
        """Allocate the state-slot and MLA-block pools (every model shares the indices)."""

    @abstractmethod
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Apply plan.pre_copies, run every batch (media rows spliced over the token embeddings; the
        draft model, if any, mirrors each batch that is not a verification, on token ids only),
        apply plan.post_copies -> fp32 logits [sum of num_logits, V] on the executor's device (the
        engine samples there)."""

    @abstractmethod
    def propose(self, plan: DraftPlan) -> torch.Tensor:
        """Greedy drafts from the draft model -> int64 CPU [N, plan.num_drafts]."""

    reads_handoff_here = False  # read_handoff gives CacheRecords in this process (handoff parts can go early)

    def read_handoff(self, slot: int, rows: torch.Tensor) -> list[CacheRecord | RemoteCacheRecord]:
        """Prefill/decode disaggregation: one sequence's caches — the state in `slot` and the latent
        rows `rows` [n] — of each model (target, then draft), on the CPU or left where they are."""
        raise ValueError(f"{type(self).__name__} cannot hand off caches")

    def write_handoff(self, records: list[CacheRecord | RemoteCacheRecord], slot: int, rows: torch.Tensor) -> None:
        """The inverse of read_handoff: write each model's record into `slot` and `rows`."""
        raise ValueError(f"{type(self).__name__} cannot take a handoff")

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture decode steps of up to max_batch sequences as CUDA graphs, where the executor can
        (called once, right after allocate_cache). Default: every step runs eagerly."""

    def health(self) -> dict:
        """Whether the model can step now: {"healthy": bool, "state": "serving" | "recovering" | ...,
        "cause": why not (or None), "actors": {name: state}, "lost_nodes": {node id: [actors last
        there]}}. Default: a model in this process, healthy while the process runs."""
        return {"healthy": True, "state": "serving", "cause": None, "actors": {}, "lost_nodes": {}}

    def shutdown(self) -> None:
        """Release what the executor holds outside this process (actors, placement groups); safe to
        call twice. Default: nothing (the model goes with the process)."""

    @property
    def has_draft_model(self) -> bool:
        return len(self.cache_layout()) > 1


class LocalExecutor(Executor):
    reads_handoff_here = True

    def __init__(self, model: K3ForCausalLM, draft_model: K3ForCausalLM | None = None) -> None:
        if not (model.is_first and model.is_last):
            raise ValueError(f"LocalExecutor needs a whole model; got layer_range {model.layer_range}")
        if draft_model is not None:
            if not (draft_model.is_first and draft_model.is_last):
                raise ValueError("the draft model must be a whole model")
            if draft_model.config.vocab_size != model.config.vocab_size:
                raise ValueError(
                    f"draft vocab_size {draft_model.config.vocab_size} != target vocab_size "
                    f"{model.config.vocab_size}"
                )
        self.model = model.eval()
        self.draft_model = None if draft_model is None else draft_model.eval()
        self.device = next(model.parameters()).device
        if draft_model is not None and next(draft_model.parameters()).device != self.device:
            raise ValueError(f"the draft model is on {next(draft_model.parameters()).device}, the model on {self.device}")
        self.cache: ModelCache | None = None
        self.draft_cache: ModelCache | None = None
        self.graphs: DecodeGraphs | None = None

    def cache_layout(self) -> CacheLayout:
        models = [self.model] + ([self.draft_model] if self.draft_model is not None else [])
        return [(m.config, m.dtype) for m in models]

    def allocate_cache(self, geometry: CacheGeometry) -> None:
        def alloc(m: K3ForCausalLM) -> ModelCache:
            return ModelCache.allocate(m.config, geometry.num_state_slots, geometry.num_blocks,
                                       geometry.block_size, m.dtype, self.device)

        self.cache = alloc(self.model)
        self.graphs = None  # captured over the previous pools
        self.draft_cache = alloc(self.draft_model) if self.draft_model is not None else None

    def _caches(self) -> list[ModelCache]:
        assert self.cache is not None, "allocate_cache() first"
        return [self.cache] + ([self.draft_cache] if self.draft_cache is not None else [])

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            src, dst = torch.tensor(pairs).T
            for cache in self._caches():
                cache.copy_states(src, dst)

    @torch.inference_mode()
    def read_handoff(self, slot: int, rows: torch.Tensor) -> list[CacheRecord]:
        return [read_record(cache, slot, rows) for cache in self._caches()]

    @torch.inference_mode()
    def write_handoff(self, records: list[CacheRecord | RemoteCacheRecord], slot: int, rows: torch.Tensor) -> None:
        caches = self._caches()
        if len(records) != len(caches):
            raise HandoffMismatchError(f"the handoff holds {len(records)} models' caches, this engine {len(caches)}")
        for cache, record in zip(caches, records):
            write_record(cache, local_record(record), slot, rows)

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        if self.device.type != "cuda":
            return  # the CPU runs eagerly
        assert self.cache is not None, "allocate_cache() first"
        block_size = self.cache.block_size
        latent = next(iter(self.cache.mla_latent.values()), None)
        blocks = 1 if latent is None else latent.shape[0] // block_size
        max_blocks = min(blocks, -(-max_model_len // block_size))
        try:
            self.graphs = DecodeGraphs(self.model, self.cache, max_batch, max_blocks)
        except RuntimeError as e:  # an op that cannot be captured: serve eagerly rather than not at all
            warnings.warn(f"CUDA graph capture failed, decode steps run eagerly: {e}", RuntimeWarning, stacklevel=2)
            self.graphs = None

    def _forward(self, b: BatchPlan, ids: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(b):
            return self.graphs.run(b)
        embeds = None
        if b.mm_positions is not None:
            embeds = splice_media_embeddings(self.model.embed(ids), b.mm_positions, b.mm_embeds)
        return self.model(ids, b.forward_batch(self.cache), logits_indices, embeds).float()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        self._copy(plan.pre_copies)
        out = []
        for b in plan.batches:
            ids, logits_indices = to_device([b.input_ids, b.logits_indices], self.device)
            out.append(self._forward(b, ids, logits_indices))
            if self.draft_model is not None and b.spec_state_slots is None:
                none = torch.zeros(0, dtype=torch.long, device=self.device)
                self.draft_model(ids, b.forward_batch(self.draft_cache), none)
        self._copy(plan.post_copies)
        if not out:
            return torch.zeros(0, self.model.config.vocab_size, device=self.device)
        return out[0] if len(out) == 1 else torch.cat(out)

    @torch.inference_mode()
    def propose(self, plan: DraftPlan) -> torch.Tensor:
        assert self.draft_model is not None and self.draft_cache is not None, "no draft model"
        n = plan.input_ids.numel()
        cu = torch.arange(n + 1)
        spec = plan.spec_state_slots
        src, (tokens,), drafts = plan.state_slots, to_device([plan.input_ids], self.device), []
        for j in range(plan.num_drafts + 1):
            # copy, then decode in place: the state after feed j lands in its own slot
            self.draft_cache.copy_states(src, spec[:, j])
            batch = ForwardBatch(cu, plan.context_lens + j, spec[:, j], plan.block_tables, self.draft_cache)
            last = j == plan.num_drafts
            logits = self.draft_model(tokens, batch, torch.zeros(0, dtype=torch.long, device=self.device) if last else None)
            if not last:
                tokens = logits.argmax(-1)
                drafts.append(tokens)
            src = spec[:, j]
        return torch.stack(drafts, 1).cpu()
