"""Continuous batching with chunked prefill: the single owner of cache bookkeeping.

Each step spends a token budget: running decodes first (1 token, or 1 + k when speculating),
then running prefills, then new sequences (FIFO, admitted while a live slot and blocks for their
first chunk are available, resuming from the prefix cache when possible). A sequence that needs
blocks preempts the newest running sequences scheduled after it (they are freed and requeued to
recompute). Prefill chunks end at snapshot boundaries so the state there can be copied out.

Long context (EngineConfig.long_prefill_token_threshold) never locks shorter requests out: one long
prompt prefills at a time (shorter waiting sequences go past the other long ones), its chunk takes
at most half of the step's remaining budget while shorter prefill work waits, long sequences
together hold at most `long_block_cap` blocks (the rest is the reserve for shorter ones), and a long
sequence preempts only long ones.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from k3ray.engine.config import EngineConfig
from k3ray.engine.core.cache_manager import CacheManager
from k3ray.engine.core.sequence import Sequence, SequenceStatus
from k3ray.engine.disagg.handoff import HandoffMismatchError
from k3ray.engine.execution.plan import BatchPlan, DraftPlan, StepPlan, pad_block_tables


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already in the caches
    num_tokens: int  # tokens fed this step (a verification: 1 + len(drafts), set by make_plan)
    decode: bool = False  # one uncomputed token, state ready: may verify drafts
    max_drafts: int = 0
    drafts: list[int] = field(default_factory=list)
    logits_start: int = 0
    num_logits: int = 0
    num_new_tokens: int = 0  # tokens appended to the sequence after the step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Every token is computed after this step, so the last logits row gives a new token."""
        return self.end == self.seq.num_tokens

    @property
    def prompt_logprobs(self) -> bool:
        seq = self.seq
        return seq.index == 0 and seq.request.needs_prompt_logprobs and self.start < seq.prompt_len - 1


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    pre_copies: list[tuple[int, int]] = field(default_factory=list)
    post_copies: list[tuple[int, int]] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)  # snapshots read by pre_copies
    snapshots: list[int] = field(default_factory=list)  # snapshots written by post_copies
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager, max_model_len: int,
                 long_block_cap: int | None = None) -> None:
        """long_block_cap: blocks long sequences may hold together (None: the whole pool)."""
        self.config = config
        self.cache = cache
        self.max_model_len = max_model_len
        self.long_threshold = config.long_prefill_token_threshold
        self.long_block_cap = cache.blocks.num_blocks if long_block_cap is None else long_block_cap
        self.num_spec = config.num_speculative_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # scheduling -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: set[int] = set()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or not _is_decode(seq):
                continue
            n = 1 + self.num_spec
            if budget < n:
                break
            if not self._grow(seq, seq.num_computed_tokens + n, scheduled, out):
                continue
            out.seqs.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, decode=True, max_drafts=self._max_drafts(seq)))
            scheduled.add(seq.seq_id)
            budget -= n
        prefills = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING
                    and seq.seq_id not in scheduled and not _is_decode(seq)]
        shorter_waits = any(not self.long_prompt(seq) for seq in prefills) or (
            len(self.running) < self.config.max_num_seqs and any(not self.long_prompt(seq) for seq in self.waiting))
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an earlier one's growth
                continue
            start = seq.num_computed_tokens
            share = budget - budget // 2 if shorter_waits and self.long_prompt(seq) else budget
            end = self._chunk_end(seq, start, share)
            self._grow(seq, end, scheduled, out)
            end = min(end, len(seq.block_table) * self.cache.block_size)
            if end > start:
                out.seqs.append(ScheduledSeq(seq, start, end - start))
                scheduled.add(seq.seq_id)
                budget -= end - start
        long_prefilling = any(self.long_prompt(seq) for seq in prefills)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            long = self.long_prompt(seq)
            if long and long_prefilling:  # the long lane is taken: shorter requests go past
                i += 1
                continue
            shorter_behind = long and any(not self.long_prompt(s) for s in list(self.waiting)[i + 1:])
            sc = self._admit(i, budget - budget // 2 if shorter_behind else budget, out)
            if sc is None:
                if long:  # it waits for blocks the reserve keeps from it; shorter ones need not
                    i += 1
                    continue
                break
            out.seqs.append(sc)
            scheduled.add(sc.seq.seq_id)
            budget -= sc.num_tokens
            long_prefilling = long_prefilling or long
        return out

    def long_prompt(self, seq: Sequence) -> bool:
        """Its prompt alone is long: it takes the long lane (one prefills at a time)."""
        return seq.prompt_len > self.long_threshold

    def backlog(self) -> tuple[int, int]:
        """Tokens still to prefill (prompts, and what preempted sequences recompute), of short and of
        long prompts."""
        short = long = 0
        for seq in (*self.waiting, *self.running):
            if not _is_decode(seq):
                if self.long_prompt(seq):
                    long += seq.num_uncomputed
                else:
                    short += seq.num_uncomputed
        return short, long

    def _max_drafts(self, seq: Sequence) -> int:
        """Drafts whose acceptance cannot overrun max_tokens or the context limit (none for a prefill-only
        sequence: it ends at its first token)."""
        if not self.num_spec or seq.request.export_from is not None:
            return 0
        left = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(self.num_spec, left - 1))

    def _chunk_end(self, seq: Sequence, start: int, budget: int) -> int:
        end = min(seq.num_tokens, start + budget)
        boundary = self.cache.next_boundary(seq, start)
        return end if boundary is None else min(end, boundary)

    def _grow(self, seq: Sequence, num_tokens: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Give seq blocks for num_tokens, preempting newer unscheduled sequences if needed (a long
        one only long ones, within long_block_cap); on shortage, seq keeps what it has and False is
        returned."""
        pool = self.cache.blocks
        want = self.cache.blocks_for(num_tokens) - len(seq.block_table)
        long = num_tokens > self.long_threshold

        def available() -> int:
            return min(pool.num_available, self._long_room(seq)) if long else pool.num_available

        need = want
        while need > available():
            victim = next((v for v in reversed(self.running) if v is not seq and v.seq_id not in scheduled
                           and (not long or v.num_tokens > self.long_threshold)), None)
            if victim is None or self.running.index(victim) < self.running.index(seq):
                need = available()
                break
            self._preempt(victim, out)
        if need > 0:
            seq.block_table += pool.allocate(need)
        return need >= want

    def _long_room(self, seq: Sequence) -> int:
        """Blocks long sequences (seq counted as one) may still take."""
        held = sum(len(s.block_table) for s in self.running if s is not seq and s.num_tokens > self.long_threshold)
        return max(0, self.long_block_cap - held - len(seq.block_table))

    def _admit(self, index: int, budget: int, out: SchedulerOutput) -> ScheduledSeq | None:
        """Start waiting sequence `index` with a first chunk of at most `budget` tokens, or None."""
        cache = self.cache
        seq = self.waiting[index]
        if cache.states.num_available < self.config.slots_per_seq:
            return None
        lookup = cache.enable_prefix_caching and not (seq.index == 0 and seq.request.needs_prompt_logprobs)
        hit = cache.find_prefix(seq) if lookup else None
        if hit is not None:
            cache.states.pin(hit.snapshot_slot)
            for b in hit.blocks:
                cache.blocks.acquire(b)
        have = len(hit.blocks) if hit else 0
        start = hit.num_tokens if hit else 0
        free = cache.blocks.num_available
        if seq.num_tokens > self.long_threshold:
            free = min(free, self._long_room(seq) - have)
        end = min(self._chunk_end(seq, start, budget), (have + free) * cache.block_size)
        if end <= start or free < 0 or cache.states.num_available < self.config.slots_per_seq:
            if hit is not None:
                cache.blocks.release(hit.blocks)
                cache.states.unpin(hit.snapshot_slot, resumed=False)
            return None
        slots = cache.states.allocate(self.config.slots_per_seq)
        seq.state_slot, seq.spec_slots = slots[0], slots[1:]
        seq.block_table = (hit.blocks if hit else []) + cache.blocks.allocate(cache.blocks_for(end) - have)
        seq.num_computed_tokens = start
        seq.num_registered_blocks = have
        if lookup:
            cache.prefix_queries += seq.num_tokens
            cache.prefix_hits += start
        if hit is not None:
            out.pre_copies.append((hit.snapshot_slot, seq.state_slot))
            out.pinned.append(hit.snapshot_slot)
        seq.status = SequenceStatus.RUNNING
        del self.waiting[index]
        self.running.append(seq)
        if seq.request.metrics.first_scheduled_time is None:
            seq.request.metrics.first_scheduled_time = time.monotonic()
        return ScheduledSeq(seq, start, end - start)

    def admit_handoff(self, seq: Sequence, start: int) -> bool:
        """Start a sequence whose prompt a prefill engine ran (prefill/decode disaggregation): a live slot,
        the cached blocks of its first `start` prompt tokens and new blocks for the rest of the prompt and
        its first token; the caller writes the handoff into them. False: no room now (it waits; the
        sequences running free theirs as they finish). Raises HandoffMismatchError when the cache no longer
        holds those first blocks."""
        cache = self.cache
        if len(self.running) >= self.config.max_num_seqs or cache.states.num_available < self.config.slots_per_seq:
            return False
        held = [cache.blocks.lookup(h) for h in cache.block_hashes(seq, start // cache.block_size)]
        if None in held:
            raise HandoffMismatchError(f"the prefix of {start} tokens the handoff leaves out is no longer cached here")
        for b in held:
            cache.blocks.acquire(b)
        need = cache.blocks_for(seq.prompt_len + 1) - len(held)
        room = cache.blocks.num_available
        if seq.prompt_len + 1 > self.long_threshold:
            room = min(room, self._long_room(seq) - len(held))
        if need > room:
            cache.blocks.release(held)
            return False
        slots = cache.states.allocate(self.config.slots_per_seq)
        seq.state_slot, seq.spec_slots = slots[0], slots[1:]
        seq.block_table = held + cache.blocks.allocate(need)
        seq.num_computed_tokens = seq.prompt_len
        seq.num_registered_blocks = len(held)
        cache.prefix_queries += seq.prompt_len
        cache.prefix_hits += start
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.request.metrics.first_scheduled_time is None:
            seq.request.metrics.first_scheduled_time = time.monotonic()
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free seq and requeue it first in line; it recomputes (from the prefix cache if it can)."""
        self.cache.register_blocks(seq)
        self._release(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.cache.blocks.release(seq.block_table)
        if seq.state_slot is not None:
            self.cache.states.release([seq.state_slot] + seq.spec_slots)
        seq.block_table, seq.state_slot, seq.spec_slots = [], None, []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def free(self, seq: Sequence) -> None:
        """Forget seq (finished or aborted) and free everything it holds."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    # plans ------------------------------------------------------------------------------------
    def draft_plan(self, rows: list[ScheduledSeq]) -> DraftPlan:
        k = max(sc.max_drafts for sc in rows)
        seqs = [sc.seq for sc in rows]
        return DraftPlan(
            input_ids=torch.tensor([s.token_ids[-1] for s in seqs]),
            context_lens=torch.tensor([s.num_tokens for s in seqs]),
            state_slots=torch.tensor([s.state_slot for s in seqs]),
            block_tables=pad_block_tables([s.block_table for s in seqs]),
            spec_state_slots=torch.tensor([s.spec_slots[: k + 1] for s in seqs]),
            num_drafts=k,
        )

    def make_plan(self, out: SchedulerOutput) -> StepPlan:
        """Tensors for the step; sequences with drafts go to a separate verification batch."""
        plain = [sc for sc in out.seqs if not sc.drafts]
        verify = [sc for sc in out.seqs if sc.drafts]
        out.seqs = plain + verify
        batches, offset = [], 0
        for rows, spec in ((plain, False), (verify, True)):
            if rows:
                batch = self._batch(rows, spec, offset)
                offset += batch.num_logits
                batches.append(batch)
        for sc in plain:
            self._reserve_snapshot(sc, out)
        return StepPlan(batches, out.pre_copies, out.post_copies)

    def _batch(self, rows: list[ScheduledSeq], spec: bool, logits_offset: int) -> BatchPlan:
        ids: list[int] = []
        cu, ctx, logits_idx = [0], [], []
        mm_positions: list[int] = []
        mm_embeds: list[torch.Tensor] = []
        for sc in rows:
            seq = sc.seq
            fed = [seq.token_ids[sc.start]] + sc.drafts if spec else seq.token_ids[sc.start : sc.end]
            sc.num_tokens = len(fed)
            base = len(ids)
            ids += fed
            media = seq.request.media
            from_prompt = sc.start + (1 if spec else len(fed))  # drafts never stand for media
            if media is not None and media.overlaps(sc.start, from_prompt):
                offsets, embeds = media.rows_in(sc.start, from_prompt)
                mm_positions += [base + o for o in offsets]
                mm_embeds.append(embeds)
            cu.append(len(ids))
            ctx.append(sc.end)
            if spec or sc.prompt_logprobs:
                rows_idx = list(range(base, base + len(fed)))
            else:
                rows_idx = [base + len(fed) - 1] if sc.samples else []
            sc.logits_start, sc.num_logits = logits_offset + len(logits_idx), len(rows_idx)
            logits_idx += rows_idx
        spec_slots = None
        if spec:
            width = max(sc.num_tokens for sc in rows)
            spec_slots = torch.tensor([sc.seq.spec_slots[:width] for sc in rows])
        return BatchPlan(
            input_ids=torch.tensor(ids, dtype=torch.long),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            state_slots=torch.tensor([sc.seq.state_slot for sc in rows], dtype=torch.int32),
            block_tables=pad_block_tables([sc.seq.block_table for sc in rows]),
            logits_indices=torch.tensor(logits_idx, dtype=torch.long),
            spec_state_slots=spec_slots,
            mm_positions=torch.tensor(mm_positions, dtype=torch.long) if mm_embeds else None,
            mm_embeds=torch.cat(mm_embeds) if mm_embeds else None,
        )

    def _reserve_snapshot(self, sc: ScheduledSeq, out: SchedulerOutput) -> None:
        """If the chunk ends on a snapshot boundary, copy the live state out after the step."""
        cache = self.cache
        if cache.next_boundary(sc.seq, sc.end - 1) != sc.end:
            return
        shared = sc.end == sc.seq.shared_boundary  # two prompts share this prefix already
        slot = cache.states.reserve_snapshot(cache.snapshot_key(sc.seq, sc.end), shared, sc.seq.seq_id, sc.end)
        if slot is not None:
            out.post_copies.append((sc.seq.state_slot, slot))
            out.snapshots.append(slot)

    # after the step -----------------------------------------------------------------------------
    def commit(self, out: SchedulerOutput, processed: dict[int, int]) -> None:
        """The step ran: `processed[seq_id]` of each sequence's fed tokens are now in the caches
        (for a verification, the last token plus the accepted drafts)."""
        for slot in out.snapshots:
            self.cache.states.commit_snapshot(slot)
        for slot in out.pinned:
            self.cache.states.unpin(slot, resumed=True)
        for sc in out.seqs:
            seq = sc.seq
            if seq.status is SequenceStatus.WAITING:
                continue
            n = processed[seq.seq_id]
            if sc.drafts and not seq.finished:
                seq.state_slot, seq.spec_slots[n - 1] = seq.spec_slots[n - 1], seq.state_slot
            seq.num_computed_tokens = min(sc.start + n, seq.num_tokens)
            self.cache.register_blocks(seq)
            if seq.finished:
                self.free(seq)

    def fail(self, out: SchedulerOutput) -> None:
        """The step did not complete: drop its snapshots and recompute its sequences."""
        for slot in out.snapshots:
            self.cache.states.drop_snapshot(slot)
        for slot in out.pinned:
            self.cache.states.unpin(slot, resumed=False)
        for sc in out.seqs:
            if sc.seq.status is SequenceStatus.RUNNING:
                self._release(sc.seq)
                self.running.remove(sc.seq)
                sc.seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(sc.seq)


def _is_decode(seq: Sequence) -> bool:
    """One token left to feed, on top of a computed state (so drafts can be verified after it)."""
    return seq.num_uncomputed == 1 and seq.num_computed_tokens > 0
