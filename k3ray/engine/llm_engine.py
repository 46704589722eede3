"""The synchronous engine: requests in, one `step()` at a time, RequestOutputs out.

    engine = LLMEngine(LocalExecutor(model), EngineConfig(max_num_seqs=8))
    engine.add_request("r0", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from k3ray.engine.config import EngineConfig, MultiModalConfig
from k3ray.engine.core.cache_manager import CacheManager, cache_bytes_for, size_cache
from k3ray.engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from k3ray.engine.core.sequence import Request, Sequence
from k3ray.engine.disagg.handoff import Handoff
from k3ray.engine.disagg.transfer import HandoffTransfer, check_handoff
from k3ray.engine.execution.executor import Executor
from k3ray.engine.input_processor import InputProcessor
from k3ray.engine.media.prompt_media import PromptMedia, VisionEncoderFn, encode_pending
from k3ray.engine.output_processor import OutputProcessor
from k3ray.engine.outputs import RequestOutput
from k3ray.engine.sample.sampler import logprob_entries, sample, sequence_generator
from k3ray.engine.sample.spec import NgramProposer, verify
from k3ray.engine.stats import EngineStats, StatsCollector
from k3ray.engine.structured.logits_processors import process_logits
from k3ray.engine.structured.manager import StructuredOutputManager
from k3ray.sampling_params import SamplingParams
from k3ray.vision import MediaConfig, ProcessedMedia


class LLMEngine:
    def __init__(self, executor: Executor, config: EngineConfig | None = None, tokenizer=None, *,
                 vision_encoder: VisionEncoderFn | None = None, multimodal: MultiModalConfig | None = None) -> None:
        """vision_encoder turns packed media into placeholder embeddings (`local_vision_encoder(model)`,
        or a VisionEncoder actor's); without one, requests with media are refused."""
        config = config or EngineConfig()
        layout = executor.cache_layout()
        self.model_config = layout[0][0]
        if vision_encoder is not None and self.model_config.vision is None:
            raise ValueError("vision_encoder was given but the model config has no vision_config")
        spec = config.speculative
        if executor.has_draft_model != (spec is not None and spec.method == "draft"):
            raise ValueError(
                "a draft model needs speculative=SpeculativeConfig(method='draft'), and that method needs "
                f"an executor with a draft model (has one: {executor.has_draft_model}, method: "
                f"{spec.method if spec else None})"
            )
        geometry = size_cache(config, layout)
        capacity = geometry.num_blocks * geometry.block_size - config.num_speculative_tokens
        limit = min(self.model_config.max_position_embeddings, capacity)
        reserve = config.reserve_tokens(capacity)
        max_model_len = config.max_model_len or min(self.model_config.max_position_embeddings, capacity - reserve)
        if max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds what fits: {self.model_config.max_position_embeddings} "
                f"positions, {geometry.num_blocks} blocks x {geometry.block_size} tokens minus "
                f"{config.num_speculative_tokens} draft positions = {capacity}"
            )
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len} leaves no room to generate; the cache is too small")
        executor.allocate_cache(geometry)
        if not config.enforce_eager:
            executor.capture_decode_graphs(config.max_num_seqs, max_model_len)
        self.executor = executor
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # the cache budget whose blocks would hold the model's whole context (for a server's start-up note)
        self.full_context_cache_bytes = cache_bytes_for(config, layout, self.model_config.max_position_embeddings)
        self.vocab_size = self.model_config.vocab_size
        spare_slots = geometry.num_state_slots - config.max_num_seqs * config.slots_per_seq
        self.cache = CacheManager(geometry, layout, config.enable_prefix_caching, config.snapshot_interval,
                                  max_protected_snapshots=spare_slots // 2)
        # long sequences together hold at most the cache less the reserve (an explicit longer max_model_len shrinks it)
        reserve_blocks = (capacity - max(capacity - reserve, max_model_len)) // geometry.block_size
        self.scheduler = Scheduler(config, self.cache, max_model_len, geometry.num_blocks - reserve_blocks)
        self.reserve_tokens = reserve_blocks * geometry.block_size
        eos = {self.model_config.eos_token_id} | set(getattr(tokenizer, "stop_token_ids", ()))
        self.output_processor = OutputProcessor(frozenset(eos), max_model_len, tokenizer)
        self.structured = StructuredOutputManager(tokenizer, self.vocab_size, self.output_processor.eos_token_ids,
                                                  config)
        self._failed: list[tuple[str, Exception]] = []
        self.proposer = NgramProposer(spec.ngram_min, spec.ngram_max) if spec and spec.method == "ngram" else None
        self.vision_encoder = vision_encoder
        multimodal = multimodal or MultiModalConfig()
        if vision_encoder is not None and multimodal.media is None:
            multimodal = replace(multimodal, media=MediaConfig.for_vision(self.model_config.vision))
        self.multimodal = multimodal
        self.inputs = InputProcessor(self.model_config, tokenizer, max_model_len, config.max_schema_bytes,
                                     vision_encoder, multimodal)
        self.requests: dict[str, Request] = {}
        self.stats = StatsCollector()
        self.handoffs = HandoffTransfer(self.scheduler, self.cache, executor, self.output_processor, self.stats)
        self._busy_since: float | None = None  # the last step's end, while requests remained
        self._stepped_at = 0.0  # when the last step began: the requests queued by then are in get_stats()
        self._rng = random.Random(config.seed)
        self._next_seq_id = 0
        self._held_queries = 0

    # requests ---------------------------------------------------------------------------------
    @property
    def prefill_chunk_tokens(self) -> int:
        """The most of one prompt a step computes: chunks end at snapshot boundaries."""
        budget = self.config.max_num_batched_tokens
        return min(budget, self.cache.snapshot_stride) if self.cache.enable_prefix_caching else budget

    @property
    def supports_media(self) -> bool:
        return self.vision_encoder is not None

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, media: Seq[ProcessedMedia] | None = None, *,
                    export_from: int | None = None, export_parts: bool = False,
                    handoff: Handoff | None = None) -> None:
        """Queue a request; raises ValueError (changing nothing) if it cannot run. `export_from`,
        `export_parts` and `handoff`: prefill/decode disaggregation, see make_request."""
        self.enqueue(self.make_request(request_id, prompt, params, arrival_time, media, export_from=export_from,
                                       export_parts=export_parts, handoff=handoff))

    def enqueue(self, request: Request) -> None:
        """Queue a request built by make_request; one with a grammar reaches the scheduler once its
        grammar is compiled (or fails then: see take_failed)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self.structured.hold(request)
            return
        self._schedule(request)

    def _schedule(self, request: Request) -> None:
        """Its sequences to the scheduler, or a handed-off one to wait for its import."""
        if request.handoff_in is not None:
            self.handoffs.waiting.append(request)
            return
        for seq in request.seqs:
            self.scheduler.add(seq)

    def take_failed(self) -> list[tuple[str, Exception]]:
        """(request_id, error) of the requests that failed since the last call without an output: a
        schema whose grammar could not be compiled (a ValueError naming why), or the compiler's fault."""
        failed, self._failed = self._failed, []
        return failed

    def make_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                     arrival_time: float | None = None, media: Seq[ProcessedMedia] | None = None, *,
                     export_from: int | None = None, export_parts: bool = False,
                     handoff: Handoff | None = None) -> Request:
        """Validate and build a request without queueing it. With `media` (preprocessed images /
        videos), the prompt holds one media placeholder per item, in order; each is expanded to the
        item's token count (a text prompt is then encoded with special tokens, so the placeholder may
        be written as its token string).

        Prefill/decode disaggregation (one sequence a request): with `export_from`, the request ends at
        its first token and its final output carries a Handoff of the caches from prompt token
        `export_from` on (a multiple of block_size the receiver holds: held_prefix_tokens); with
        `export_parts` too (DELTA outputs), each prompt chunk but the last sends the latent rows it
        computed as a HandoffPart in `handoff_parts` of a non-final output, where the executor reads
        them here (a Ray pipeline's stay at its stages until the end), and the final Handoff the rest;
        with `handoff` (parts joined), the request starts from one, at its second token."""
        params = SamplingParams() if params is None else params
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        prompt = self.inputs.process(prompt, params, media)
        # one sampler and one detokenizer per sequence (n / best_of)
        generators = [sequence_generator(self._rng, params.seed, i) for i in range(params.num_sequences)]
        detoks = [self.output_processor.new_detokenizer(params.skip_special_tokens) for _ in generators]
        request = Request(request_id, prompt.text, prompt.token_ids, params,
                          time.monotonic() if arrival_time is None else arrival_time, prompt.media)
        request.seqs = [Sequence(self._next_seq_id + i, request, i, generator, detok)
                        for i, (generator, detok) in enumerate(zip(generators, detoks))]
        if export_from is not None or handoff is not None or export_parts:
            check_handoff(request, self.cache.block_size, export_from, export_parts, handoff)
            request.export_from, request.handoff_in = export_from, handoff
            request.export_parts = export_parts and self.executor.reads_handoff_here
            request.rows_sent = export_from
        if params.structured_outputs is not None:
            request.grammar = self.structured.compile(params.structured_outputs)
        self._next_seq_id += len(request.seqs)
        return request

    def held_prefix_tokens(self, prompt: str | Seq[int], media: Seq[ProcessedMedia] | None = None) -> int:
        """How many of the prompt's first tokens this engine's prefix cache holds as whole blocks (at most
        all but its last token): what a prefill engine may leave out of a handoff to it."""
        if not self.cache.enable_prefix_caching:
            return 0
        self._held_queries += 1
        seq = self.make_request(f"held-prefix-{self._held_queries}", prompt, SamplingParams(max_tokens=1),
                                media=media).seqs[0]
        held = 0
        for h in self.cache.block_hashes(seq, (seq.prompt_len - 1) // self.cache.block_size):
            if self.cache.blocks.lookup(h) is None:
                break
            held += self.cache.block_size
        return held

    def prepare_structured_outputs(self) -> None:
        """Load xgrammar and this vocabulary as it sees it (seconds), as a server does at start: on the
        first constrained request that load would otherwise share the GIL with the steps of others."""
        self.structured.prepare()

    def close(self) -> None:
        """Stop the grammar workers (the engine's only processes of its own); requests waiting for a
        grammar fail, and a later constrained request starts new workers."""
        self.structured.close()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its caches; its final output (finish_reason 'abort'), or None."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.structured.drop(request_id)
        if request in self.handoffs.waiting:
            self.handoffs.waiting.remove(request)
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.free(seq)
                self.output_processor.abort(seq)
        request.metrics.finished_time = time.monotonic()
        if not self.requests:
            self._busy_since = None
        return request.output_of_kind(finished=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step -> the outputs of the requests it advanced, each of its params.output_kind:
        cumulative, what is new since its previous output (DELTA), or only when it finishes (FINAL_ONLY)."""
        self._admit_grammars()
        # a step's time runs from the previous one's end while requests remained: what a waiting
        # request sees (the caller's work between steps included); idle time is never counted
        self._stepped_at = time.monotonic()
        started = self._stepped_at if self._busy_since is None else self._busy_since
        touched = self._import_handoffs()  # the requests whose outputs this step sends, from the imports on
        out = self.scheduler.schedule()
        if not out.seqs:
            # the oldest running sequence can always preempt the rest, so work means progress
            assert not self.scheduler.has_work(), "the scheduler made no progress"
            if self.structured.awaiting and not touched:  # only grammars to wait for: wait a moment, not spin
                self.structured.wait()
            self._busy_since = None  # nothing to compute: waiting here is idle time for the rates
            return self._outputs_of(touched)
        try:
            self._encode_media(out)
            self._propose(out)
            plan = self.scheduler.make_plan(out)
            logits = self.executor.execute(plan)
            processed = self._process(out, logits)
            parted = self.handoffs.export(out)
        except BaseException:
            self.scheduler.fail(out)
            raise
        self.scheduler.commit(out, processed)
        self.stats.num_steps += 1
        for sc in out.seqs:
            if sc.num_new_tokens or sc.seq.finished or sc.seq.request in parted:
                touched[sc.seq.request.request_id] = sc.seq.request
        outputs = self._outputs_of(touched)
        ended = time.monotonic()
        self._observe_rates(out, ended - started)
        self._busy_since = ended if self.requests else None
        return outputs

    # grammars and handoffs that became ready -------------------------------------------------------
    def _admit_grammars(self) -> None:
        """Requests whose grammar is compiled go to the scheduler; those whose compile failed end."""
        ready, failed = self.structured.admit()
        self._fail(failed)
        for request in ready:
            self._schedule(request)

    def _import_handoffs(self) -> dict[str, Request]:
        """The waiting handoffs that fit, written into the caches -> the requests imported (their first
        tokens go out this step)."""
        imported, failed = self.handoffs.import_waiting()
        self._fail(failed)
        return {request.request_id: request for request in imported}

    def _fail(self, failed: list[tuple[Request, Exception]]) -> None:
        for request, error in failed:
            del self.requests[request.request_id]
            request.metrics.finished_time = time.monotonic()
            self._failed.append((request.request_id, error))

    def _observe_rates(self, out: SchedulerOutput, seconds: float) -> None:
        """This step's prefill tokens of each lane and its decode tokens, for the measured rates."""
        short = long = decode = 0
        for sc in out.seqs:
            if sc.decode:
                decode += sc.num_new_tokens
            elif self.scheduler.long_prompt(sc.seq):
                long += sc.num_tokens
            else:
                short += sc.num_tokens
        self.stats.observe_step(seconds, short, long, decode)

    def _encode_media(self, out: SchedulerOutput) -> None:
        """Encode (once per request, in one call per step) the media this step's chunks reach."""
        pending: dict[str, PromptMedia] = {}
        for sc in out.seqs:
            media = sc.seq.request.media
            if media is not None and media.embeds is None and media.overlaps(sc.start, sc.end):
                pending[sc.seq.request.request_id] = media
        if pending:
            encode_pending(self.vision_encoder, list(pending.values()), self.model_config.hidden_size)
            self.stats.media_items_encoded += sum(len(m.spans) for m in pending.values())

    def _propose(self, out: SchedulerOutput) -> None:
        # drafts are verified on the raw logits, so sequences whose logits are processed never speculate
        rows = [sc for sc in out.seqs if sc.decode and sc.max_drafts > 0 and not sc.seq.params.processes_logits]
        if not rows:
            return
        if self.proposer is not None:
            for sc in rows:
                sc.drafts = self.proposer.propose(sc.seq, sc.max_drafts)
        else:
            drafts = self.executor.propose(self.scheduler.draft_plan(rows))
            for sc, row in zip(rows, drafts.tolist()):
                sc.drafts = row[: sc.max_drafts]

    def _process(self, out: SchedulerOutput, logits: torch.Tensor) -> dict[int, int]:
        """Sample / verify and append tokens -> how many fed tokens each sequence keeps."""
        processed: dict[int, int] = {}
        new_tokens: dict[int, list[int]] = {}
        to_sample: list[ScheduledSeq] = []
        for sc in out.seqs:
            seq = sc.seq
            processed[seq.seq_id] = sc.num_tokens
            if not sc.decode:
                self.stats.prompt_tokens += sc.num_tokens
            if sc.prompt_logprobs:
                self._prompt_logprobs(sc, logits[sc.logits_start : sc.logits_start + sc.num_logits])
            if sc.drafts:
                rows = logits[sc.logits_start : sc.logits_start + sc.num_logits]
                new_tokens[seq.seq_id] = verify(rows, sc.drafts, seq.params, seq.generator)
                processed[seq.seq_id] = len(new_tokens[seq.seq_id])
                self.stats.spec_draft_tokens += len(sc.drafts)
                self.stats.spec_accepted_tokens += len(new_tokens[seq.seq_id]) - 1
                self.stats.spec_verifications += 1
            elif sc.samples:
                to_sample.append(sc)
        if to_sample:
            last_rows = self._process_logits(logits[[sc.logits_start + sc.num_logits - 1 for sc in to_sample]],
                                             [sc.seq for sc in to_sample])
            tokens = sample(last_rows, [sc.seq.params for sc in to_sample], [sc.seq.generator for sc in to_sample])
            for sc, token in zip(to_sample, tokens):
                new_tokens[sc.seq.seq_id] = [token]
        for sc in out.seqs:
            if sc.seq.seq_id in new_tokens:
                self._append(sc, logits, new_tokens[sc.seq.seq_id])
        return processed

    def _process_logits(self, rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """rows [M, V] -> the logits each sequence samples from: its logit_bias, penalties and grammar mask."""
        if not any(seq.params.processes_logits for seq in seqs):
            return rows
        rows = process_logits(rows, [seq.params for seq in seqs], [seq.token_ids for seq in seqs],
                              [seq.prompt_len for seq in seqs])
        self.structured.mask(rows, seqs)
        return rows

    def _append(self, sc: ScheduledSeq, logits: torch.Tensor, tokens: list[int]) -> None:
        seq = sc.seq
        entries: list = [None] * len(tokens)
        ranked = seq.params.num_sequences > seq.params.n  # best_of: needs each token's log-prob
        if seq.params.logprobs is not None or ranked:
            first = sc.logits_start if sc.drafts else sc.logits_start + sc.num_logits - 1
            entries = logprob_entries(logits[first : first + len(tokens)], tokens, seq.params.logprobs or 0)
        for token, entry in zip(tokens, entries):
            if seq.grammar is not None:
                seq.grammar.accept(token)
            self.stats.generation_tokens += 1
            sc.num_new_tokens += 1
            if self.output_processor.append(seq, token, entry):
                break

    def _prompt_logprobs(self, sc: ScheduledSeq, rows: torch.Tensor) -> None:
        """Row i predicts prompt token start + i + 1; positions already scored (before a preemption)
        are skipped."""
        request = sc.seq.request
        first = len(request.prompt_logprobs)
        stop = min(sc.end, len(request.prompt_token_ids) - 1)
        if stop < first:
            return
        skip = first - (sc.start + 1)
        targets = request.prompt_token_ids[first : stop + 1]
        request.prompt_logprobs += logprob_entries(rows[skip : skip + len(targets)], targets, request.params.prompt_logprobs)

    def _outputs_of(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The outputs of the requests that advanced or finished (finished ones leave the engine)."""
        outputs = []
        now = time.monotonic()
        for rid, request in touched.items():
            finished = request.finished
            if finished and rid in self.requests:
                request.metrics.finished_time = now
                del self.requests[rid]
                self.stats.finished(request.metrics, max(s.num_output_tokens for s in request.seqs))
            output = request.output_of_kind(finished)
            if output is not None:
                outputs.append(output)
        return outputs

    # metrics ----------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s = self.scheduler
        backlog = s.backlog()
        return self.stats.snapshot(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + sum(len(r.seqs) for r in (*self.structured.awaiting.values(),
                                                                   *self.handoffs.waiting)),
            num_preemptions=s.num_preemptions,
            cache=self.cache.usage(),
            prefix_cache_queries=self.cache.prefix_queries,
            prefix_cache_hits=self.cache.prefix_hits,
            cached_prefixes=self.cache.resumable_prefixes(),
            prefill_backlog_tokens=backlog[0],
            long_prefill_backlog_tokens=backlog[1],
            as_of=self._stepped_at,
        )

    def reset_prefix_cache(self) -> None:
        self.cache.reset_prefix_cache()

