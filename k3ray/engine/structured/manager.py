"""A request's grammar from its schema to its mask: compiled off the step (GrammarCompiler, started by the
first constrained request), held back from the scheduler until it is ready, then one matcher state per
sequence that masks its logits."""

from __future__ import annotations

import weakref

import torch

from k3ray.engine.config import EngineConfig
from k3ray.engine.core.sequence import Request, Sequence
from k3ray.engine.structured.grammar_compiler import GrammarCompiler, GrammarJob, GrammarLimits
from k3ray.sampling_params import StructuredOutputsParams

GRAMMAR_WAIT_S = 0.02  # a step with nothing to run but requests waiting for grammars waits this long for a compile


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, config: EngineConfig) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.limits = GrammarLimits.of(config)
        self._compiler: GrammarCompiler | None = None
        self._close_compiler = None
        self._outputs = None  # the compiler's StructuredOutputs (matchers, masks), once a grammar is compiled
        self.awaiting: dict[str, Request] = {}  # queued in the engine, not yet in the scheduler

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler over this vocabulary (its workers and compiled-grammar cache)."""
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids, self.limits)
            self._close_compiler = weakref.finalize(self, self._compiler.close)
        return self._compiler

    @property
    def started(self) -> bool:
        return self._compiler is not None

    def compile(self, structured_outputs: StructuredOutputsParams) -> GrammarJob:
        """Start compiling a request's grammar; a schema known to fail raises now."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the engine's tokenizer")
        job = self.compiler.compile(structured_outputs)
        if job.done and job.error is not None:
            self.compiler.release(job)
            raise job.error
        return job

    def prepare(self) -> None:
        """Load xgrammar and this vocabulary as it sees it (seconds), as a server does at start."""
        if self.tokenizer is not None:
            self.compiler.load()

    def close(self) -> None:
        """Stop the grammar workers; requests waiting for a grammar fail, a later one starts new workers."""
        if self._close_compiler is not None:
            self._close_compiler()
            self._compiler = self._close_compiler = None

    def hold(self, request: Request) -> None:
        self.awaiting[request.request_id] = request

    def drop(self, request_id: str) -> bool:
        """Forget a request still waiting for its grammar -> whether it was waiting."""
        request = self.awaiting.pop(request_id, None)
        if request is None:
            return False
        self.compiler.release(request.grammar)
        return True

    def admit(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """The waiting requests whose grammar is compiled (each sequence given its matcher state) and those
        whose compile failed (ended now)."""
        ready, failed = [], []
        for request_id, request in list(self.awaiting.items()):
            job = request.grammar
            if not job.done:
                continue
            del self.awaiting[request_id]
            self.compiler.release(job)
            if job.error is not None:
                failed.append((request, job.error))
                continue
            self._outputs = self.compiler.outputs
            for seq in request.seqs:
                seq.grammar = self._outputs.new_state(job.compiled, request.params.stop_token_ids,
                                                      strict=not request.params.structured_outputs.free_text)
            ready.append(request)
        return ready, failed

    def wait(self) -> None:
        """Only grammars to wait for: wait a moment for a compile, not spin."""
        self.compiler.wait(GRAMMAR_WAIT_S)

    def mask(self, rows: torch.Tensor, seqs: list[Sequence]) -> None:
        """rows [M, V]: the tokens each sequence's grammar forbids -> -inf, in place."""
        if any(seq.grammar is not None for seq in seqs):
            self._outputs.mask(rows, [seq.grammar for seq in seqs])
