"""Prefill/decode disaggregation: what a prefill engine hands a decode engine for one request.

A prefill engine runs a prompt and samples its first token; the decode engine continues from the
caches at the end of the prompt. For K3 that is, per request, the MLA latent rows of the prompt
tokens the decode side does not hold yet (576 values a token in each MLA layer) and, per KDA layer,
the recurrent state [H, K, K] fp32 and the conv tail [3 * H * K, W - 1] after the prompt's last
token: fixed-size, so it always travels (no prefix of the prompt holds it). With it go the first
token, its log-probs, the sampler's generator state and the prompt's log-probs; the decode side
replays the first token through its own stop checks, detokenizer, penalties and grammar.

    records = executor.read_handoff(slot, rows)       # prefill side: [start, prompt_len) rows
    executor.write_handoff(records, slot, rows)       # decode side: into its own slot and blocks

`Handoff.pack()` turns the tensors into one flat byte array (numpy), which Ray's object store
carries without a copy on read; `Handoff.unpack` reverses it.

Overlap: a prefill request exported with parts (LLMEngine `export_parts`) also sends, after each
prompt chunk but the last, a HandoffPart of the latent rows that chunk computed, so most rows travel
while later chunks compute; its final Handoff then carries the rest (from `rows_from`), and
`Handoff.joined(parts)` makes the whole one the decode engine imports.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from k3ray.engine.outputs import PositionLogprobs
from k3ray.models.forward_batch import ModelCache

ALIGN = 8  # bytes


class HandoffMismatchError(ValueError):
    """The decode side no longer holds the prefix the handoff leaves out (evicted since it was asked),
    or the handoff is for another prompt or model: run the prefill again from token 0."""


@dataclass
class CacheRecord:
    """One model's caches of one sequence (keyed by absolute layer index, as ModelCache).

    kda_state[l]  [H, K, K] fp32    after the prompt's last token
    conv_state[l] [3 * H * K, W - 1]
    mla_latent[l] [n, D]            the latent rows of prompt positions [start, start + n)
    """

    kda_state: dict[int, torch.Tensor] = field(default_factory=dict)
    conv_state: dict[int, torch.Tensor] = field(default_factory=dict)
    mla_latent: dict[int, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for kind in ("kda_state", "conv_state", "mla_latent"):
            for layer, t in getattr(self, kind).items():
                out[f"{kind}.{layer}"] = t
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes of the state (KDA + conv) and of the latent rows."""
        def total(d: dict[int, torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in d.values())

        return {"state": total(self.kda_state) + total(self.conv_state), "mla_latent": total(self.mla_latent)}

    def layers(self) -> set[int]:
        return {*self.kda_state, *self.mla_latent}

    def to(self, device: torch.device | str) -> CacheRecord:
        def moved(d: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {l: t.to(device) for l, t in d.items()}

        return CacheRecord(moved(self.kda_state), moved(self.conv_state), moved(self.mla_latent))

    def select(self, layers: range) -> CacheRecord:
        """The part a pipeline stage of `layers` holds."""
        def keep(d: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {l: t for l, t in d.items() if l in layers}

        return CacheRecord(keep(self.kda_state), keep(self.conv_state), keep(self.mla_latent))

    @classmethod
    def merge(cls, parts: list[CacheRecord]) -> CacheRecord:
        """The stages' parts as one record (their layers are disjoint)."""
        merged = cls()
        for p in parts:
            merged.kda_state.update(p.kda_state)
            merged.conv_state.update(p.conv_state)
            merged.mla_latent.update(p.mla_latent)
        return merged


class RemoteCacheRecord(ABC):
    """One model's caches of one sequence left where they were read (a Ray pipeline's stages, each its
    layers' part): a receiver laid out the same way writes each part from where it is, any other one
    materializes the record first."""

    @abstractmethod
    def materialize(self) -> CacheRecord:
        """The whole record, fetched here."""

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """As CacheRecord.nbytes, without fetching."""

    @property
    @abstractmethod
    def transport(self) -> str:
        """How its parts travel, as handoff stats name it (e.g. "stage-direct")."""


def local_record(record: CacheRecord | RemoteCacheRecord) -> CacheRecord:
    return record if isinstance(record, CacheRecord) else record.materialize()


def read_record(cache: ModelCache, slot: int, rows: torch.Tensor, device: torch.device | str = "cpu") -> CacheRecord:
    """Copy one sequence's state (slot) and latent rows [n] out of `cache`, to `device`."""
    return CacheRecord(
        {l: t[slot].to(device, copy=True) for l, t in cache.kda_state.items()},
        {l: t[slot].to(device, copy=True) for l, t in cache.conv_state.items()},
        {l: t[rows.to(t.device)].to(device) for l, t in cache.mla_latent.items()},
    )


def write_record(cache: ModelCache, record: CacheRecord, slot: int, rows: torch.Tensor) -> None:
    """Write a record into `cache`: its state into `slot`, its latent rows at `rows` [n]."""
    for name in ("kda_state", "conv_state", "mla_latent"):
        mine, theirs = getattr(cache, name), getattr(record, name)
        if set(mine) != set(theirs):
            raise HandoffMismatchError(f"the handoff's {name} layers {sorted(theirs)} are not this cache's "
                                       f"{sorted(mine)}")
        for layer, pool in mine.items():
            src = theirs[layer]
            fits = src.shape[1:] == pool.shape[1:] if name == "mla_latent" else src.shape == pool.shape[1:]
            if not fits:
                raise HandoffMismatchError(f"{name}[{layer}] of shape {tuple(src.shape)} does not fit the pool "
                                           f"{tuple(pool.shape)}")
    for l, pool in cache.kda_state.items():
        pool[slot] = record.kda_state[l].to(pool.device, pool.dtype)
    for l, pool in cache.conv_state.items():
        pool[slot] = record.conv_state[l].to(pool.device, pool.dtype)
    for l, pool in cache.mla_latent.items():
        assert record.mla_latent[l].shape[0] == rows.numel(), (record.mla_latent[l].shape, rows.numel())
        pool[rows.to(pool.device)] = record.mla_latent[l].to(pool.device, pool.dtype)


def latent_rows(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """The latent-cache rows [end - start] int64 of positions [start, end) of a sequence."""
    pos = torch.arange(start, end)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


@dataclass
class Handoff:
    """One request's prefill result. `start`: prompt tokens the receiver already holds (whole blocks),
    so `records[i].mla_latent` rows cover [start, len(prompt_token_ids)) (from `rows_from` when parts
    sent the rows before: see joined); records: the target model's, then a draft model's."""

    request_id: str
    prompt_token_ids: list[int]
    start: int
    records: list[CacheRecord | RemoteCacheRecord]
    first_token: int
    first_logprobs: PositionLogprobs | None  # the first token's entry, when log-probs were asked
    generator_state: torch.Tensor | None  # the sampler's torch.Generator state after the first sample
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prefill_seconds: float = 0.0  # arrival to first token on the prefill side
    packed: tuple | None = None  # (layout, flat bytes) while in transit: see pack()
    rows_from: int | None = None  # the records' rows start here when HandoffParts carried [start, rows_from)

    @property
    def latent_from(self) -> int:
        """The first prompt position of the records' latent rows."""
        return self.start if self.rows_from is None else self.rows_from

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the caches it carries: state (KDA + conv) and MLA latent rows, over its records."""
        total = {"state": 0, "mla_latent": 0}
        for r in self.records:
            for k, v in r.nbytes().items():
                total[k] += v
        return total

    @property
    def transport(self) -> str:
        """How its caches travel: "host" (through the replicas) or, for records left at a pipeline's
        stages (each stage's part written by the receiving stage that holds those layers), theirs:
        "stage-direct" (Ray's object store), "stage-direct-nixl" (Ray's NIXL tensor transport)."""
        remote = [r.transport for r in self.records if isinstance(r, RemoteCacheRecord)]
        return remote[0] if remote else "host"

    def materialized(self) -> Handoff:
        """Every record fetched here (for a receiver outside Ray: an engine process)."""
        return replace(self, records=[local_record(r) for r in self.records])

    def pack(self) -> Handoff:
        """The same handoff with its tensors in one flat uint8 numpy array (Ray reads numpy arrays out
        of its object store without copying them); records left at their stages stay there."""
        if self.packed is not None or self.transport != "host":
            return self
        return replace(self, records=[], packed=pack_records(self.records))

    def unpack(self) -> Handoff:
        """Tensors again: views of the flat array (read-only where Ray's object store holds it)."""
        if self.packed is None:
            return self
        return replace(self, records=unpack_records(self.packed), packed=None)

    def joined(self, parts: list[HandoffPart]) -> Handoff:
        """This final handoff with the parts sent before it (rows [start, rows_from), in order) as one
        handoff whose records cover [start, len): what an engine imports."""
        at = self.start
        for part in parts:
            if part.request_id != self.request_id or part.rows_from != at:
                raise HandoffMismatchError(f"handoff part [{part.rows_from}, {part.rows_to}) of {part.request_id!r} "
                                           f"does not continue {self.request_id!r} at row {at}")
            at = part.rows_to
        if at != self.latent_from:
            raise HandoffMismatchError(f"the parts of {self.request_id!r} end at row {at}, its final handoff's rows "
                                       f"start at {self.latent_from}")
        if not parts:
            return self
        final = self.unpack()
        pieces = [p.unpack().records for p in parts] + [final.records]
        records = [CacheRecord(r.kda_state, r.conv_state,
                               {l: torch.cat([piece[i].mla_latent[l] for piece in pieces]) for l in r.mla_latent})
                   for i, r in enumerate(final.records)]
        return replace(final, records=records, rows_from=None)


@dataclass
class HandoffPart:
    """Latent rows [rows_from, rows_to) of an exported prompt, read once a prefill chunk computed them
    and sent while the later chunks run (only MLA rows: a row never changes once computed, the KDA
    state does until the last chunk). Records: the target model's, then a draft model's."""

    request_id: str
    rows_from: int
    rows_to: int
    records: list[CacheRecord]
    packed: tuple | None = None

    def nbytes(self) -> int:
        return sum(r.nbytes()["mla_latent"] for r in self.unpack().records)

    def pack(self) -> HandoffPart:
        return self if self.packed is not None else replace(self, records=[], packed=pack_records(self.records))

    def unpack(self) -> HandoffPart:
        return self if self.packed is None else replace(self, records=unpack_records(self.packed), packed=None)


def pack_records(records: list[CacheRecord]) -> tuple:
    """(count, layout, one flat uint8 numpy array) of the records' tensors, each aligned to ALIGN bytes."""
    layout, chunks, offset = [], [], 0
    for i, r in enumerate(records):
        for key, t in r.tensors().items():
            t = t.contiguous()
            raw = t.view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
            layout.append((i, key, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, raw.numel()))
            pad = -raw.numel() % ALIGN  # every tensor starts aligned, so it views back as its dtype
            chunks += [raw, torch.zeros(pad, dtype=torch.uint8)]
            offset += raw.numel() + pad
    flat = torch.cat(chunks).numpy() if chunks else np.zeros(0, np.uint8)
    return len(records), layout, flat


def unpack_records(packed: tuple) -> list[CacheRecord]:
    """The records of pack_records, as views of its flat array."""
    n, layout, flat = packed
    with warnings.catch_warnings():  # read-only from Ray's object store: only ever read here
        warnings.simplefilter("ignore", UserWarning)
        buffer = torch.from_numpy(flat)
    records = [CacheRecord() for _ in range(n)]
    for i, key, dtype, shape, offset, size in layout:
        kind, layer = key.rsplit(".", 1)
        t = buffer[offset : offset + size].view(getattr(torch, dtype)).view(shape)
        getattr(records[i], kind)[int(layer)] = t
    return records
