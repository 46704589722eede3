"""Grammar compilation off the engine's step: a request's grammar compiles while the engine keeps
stepping the others, and no schema can stall or grow the engine's process.

    grammars = GrammarCompiler(tokenizer, vocab_size, stop_token_ids, GrammarLimits.of(config))
    job = grammars.compile(params.structured_outputs)   # returns at once; the compile starts now
    ... later, between steps: job.done -> job.compiled (an xgrammar CompiledGrammar) or job.error
    grammars.release(job)                               # its request got it, or left
    grammars.close()

Each compile runs in a worker process (grammar_worker.py) watched by a thread of its own: a worker
that runs past the time limit or whose memory grows past the limit is killed (and restarted for
the next schema), and the request fails with a ValueError naming the limit. The compiled grammar
comes back serialized and is deserialized on the watching thread (xgrammar releases the GIL), then
kept in an LRU cache bounded in bytes. Requests that want the same schema share one compile; a
schema that failed is remembered, so asking again fails at once. xgrammar (seconds to import)
and the vocabulary as it sees it are loaded by `load()`, which a server calls at start, else by
the first watching thread: never on the step's.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import psutil

from k3ray.engine.config import EngineConfig
from k3ray.engine.pipe import recv, send
from k3ray.sampling_params import StructuredOutputsParams

POLL_S = 0.02  # how often a compile's time and memory are checked
WORKER_START_TIMEOUT_S = 300.0
MAX_REMEMBERED_FAILURES = 256
MiB = 1024**2


@dataclass(frozen=True)
class GrammarLimits:
    timeout_s: float
    memory_bytes: int  # the worker's growth while it compiles
    cache_bytes: int  # every compiled grammar kept; no one grammar may be larger
    workers: int

    @classmethod
    def of(cls, config: EngineConfig | None = None) -> GrammarLimits:
        """The config's limits (EngineConfig's defaults without one)."""
        config = config or EngineConfig()
        return cls(config.grammar_compile_timeout_s, config.grammar_compile_memory_bytes, config.grammar_cache_bytes,
                   config.grammar_compile_workers)


class GrammarJob:
    """One schema's compile, shared by the requests waiting for it. `done` is set last, after
    `compiled` or `error`."""

    def __init__(self, key: str, params: StructuredOutputsParams) -> None:
        self.key = key
        self.params = params
        self.waiters = 0
        self.started = False
        self.compiled = None
        self.error: Exception | None = None
        self.done = False

    def finish(self, compiled=None, error: Exception | None = None) -> None:
        self.compiled, self.error = compiled, error
        self.done = True


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits.of()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Condition()
        self._queue: deque[GrammarJob] = deque()
        self._jobs: dict[str, GrammarJob] = {}  # queued or compiling
        self._cache: OrderedDict[str, object] = OrderedDict()  # key -> CompiledGrammar, least recent first
        self._cache_bytes = 0
        self._failed: OrderedDict[str, Exception] = OrderedDict()
        self._finished = threading.Event()
        self._outputs = None  # StructuredOutputs, built by the first watching thread
        self._outputs_lock = threading.Lock()
        self._vocab: list[bytes] | None = None
        self._workers: set[GrammarWorker] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def outputs(self):
        """The StructuredOutputs (matchers, masks) of this vocabulary: there once a compile is done."""
        assert self._outputs is not None, "no grammar has been compiled yet"
        return self._outputs

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    def compile(self, params: StructuredOutputsParams) -> GrammarJob:
        """The compile of params' grammar: done already when cached (or known to fail), else queued."""
        key = hashlib.sha256(repr(params).encode()).hexdigest()  # a frozen dataclass of text, ints and tuples
        with self._lock:
            assert not self._closed, "the grammar compiler is closed"
            job = self._jobs.get(key)
            if job is None:
                job = GrammarJob(key, params)
                if key in self._cache:
                    self._cache.move_to_end(key)
                    job.finish(compiled=self._cache[key])
                elif key in self._failed:
                    self._failed.move_to_end(key)
                    error = self._failed[key]
                    job.finish(error=type(error)(*error.args))  # its own: a raised error collects a traceback
                else:
                    self._jobs[key] = job
                    self._queue.append(job)
                    self._start_threads()
                    self._lock.notify()
            job.waiters += 1
            return job

    def release(self, job: GrammarJob) -> None:
        """A request stops waiting for job; a compile nobody waits for any more is dropped unless it
        has started (then it finishes into the cache: a client that gave up may well ask again)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and not job.started and not job.done:
                self._queue.remove(job)
                del self._jobs[job.key]

    def wait(self, timeout_s: float) -> None:
        """Until a compile finishes, or timeout_s."""
        self._finished.wait(timeout_s)
        self._finished.clear()

    def close(self) -> None:
        """Stop the workers; queued and running compiles fail."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            workers = list(self._workers)
        for worker in workers:
            worker.kill()  # its watching thread notices, fails its job and cleans up

    # the watching threads ---------------------------------------------------------------------
    def _start_threads(self) -> None:
        while len(self._threads) < self.limits.workers:
            thread = threading.Thread(target=self._watch, name=f"grammar-compiler-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _watch(self) -> None:
        worker: GrammarWorker | None = None
        try:
            while (job := self._next_job()) is not None:
                try:
                    outputs = self.load()
                    if worker is not None and not worker.alive:  # stopped at a limit, or crashed
                        self._stop_worker(worker)
                        worker = None
                    if worker is None:
                        worker = self._start_worker()
                    text = worker.compile(job.params, self.limits)
                    self._finish(job, compiled=outputs.deserialize(text))
                except ValueError as e:  # the schema's fault (or its size): the same schema fails the same way
                    self._finish(job, error=e, remember=True)
                except Exception as e:  # noqa: BLE001 - the request fails with the cause; the next compile retries
                    self._finish(job, error=RuntimeError(f"the grammar compiler failed: {type(e).__name__}: {e}"))
                if worker is not None and worker.grown() > self.limits.memory_bytes // 2:
                    self._stop_worker(worker)  # a fresh one for the next schema
                    worker = None
        finally:
            if worker is not None:
                self._stop_worker(worker)

    def _next_job(self) -> GrammarJob | None:
        with self._lock:
            while not self._queue and not self._closed:
                self._lock.wait()
            if self._closed:
                for job in self._queue:
                    job.finish(error=RuntimeError("the grammar compiler was closed"))
                self._queue.clear()
                return None
            job = self._queue.popleft()
            job.started = True
            return job

    def load(self):
        """Import xgrammar and build the StructuredOutputs of this vocabulary, once (the first compile
        does it on its watching thread unless it was done before)."""
        with self._outputs_lock:
            if self._outputs is None:
                # lazy: xgrammar (and transformers under it) only once a request asks for structured output
                from k3ray.engine.structured.structured_output import StructuredOutputs, encoded_vocab

                self._vocab = encoded_vocab(self._tokenizer, self._vocab_size)
                self._outputs = StructuredOutputs(self._vocab, self._stop_token_ids)
            return self._outputs

    def _start_worker(self) -> GrammarWorker:
        worker = GrammarWorker(self._vocab, self._stop_token_ids)
        with self._lock:
            if self._closed:
                worker.stop()
                raise RuntimeError("the grammar compiler was closed")
            self._workers.add(worker)
        return worker

    def _stop_worker(self, worker: GrammarWorker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.stop()

    def _finish(self, job: GrammarJob, compiled=None, error: Exception | None = None, remember: bool = False) -> None:
        with self._lock:
            self._jobs.pop(job.key, None)
            if compiled is not None:
                self._keep(job.key, compiled)
            elif remember:
                self._failed[job.key] = error
                while len(self._failed) > MAX_REMEMBERED_FAILURES:
                    self._failed.popitem(last=False)
        job.finish(compiled, error)
        self._finished.set()

    def _keep(self, key: str, compiled) -> None:
        size = compiled.memory_size_bytes
        while self._cache and self._cache_bytes + size > self.limits.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.memory_size_bytes
        self._cache[key] = compiled
        self._cache_bytes += size


class GrammarWorker:
    """One grammar_worker process: started with the vocabulary, then one compile at a time."""

    def __init__(self, vocab: list[bytes], stop_token_ids: list[int]) -> None:
        parent_end, child_end = socket.socketpair()
        # off the working directory, as EngineClient starts the engine (a checkout there would shadow the package)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "k3ray.engine.structured.grammar_worker", str(child_end.fileno())],
            pass_fds=(child_end.fileno(),), cwd=tempfile.gettempdir())
        child_end.close()
        self.conn = Connection(parent_end.detach())
        try:
            send(self.conn, (vocab, stop_token_ids))
            deadline = time.monotonic() + WORKER_START_TIMEOUT_S
            while not self.conn.poll(POLL_S):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the grammar worker did not start (exit code {self.process.poll()})")
            assert recv(self.conn) == ("ready",)
            self._memory = psutil.Process(self.process.pid)
            self.baseline = self._rss()
        except BaseException:
            self.stop()
            raise

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def grown(self) -> int:
        """Bytes its memory grew since it was ready."""
        return self._rss() - self.baseline if self.alive else 0

    def compile(self, params: StructuredOutputsParams, limits: GrammarLimits) -> str:
        """The compiled grammar, serialized; ValueError naming the limit the compile ran past (the
        worker is then stopped) or the schema's own error."""
        send(self.conn, ("compile", params, limits.cache_bytes))
        deadline = time.monotonic() + limits.timeout_s
        while not self.conn.poll(POLL_S):
            if not self.alive:
                raise ValueError(f"{params.field}: the grammar engine crashed compiling its grammar "
                                 f"(exit code {self.process.returncode})")
            if self.grown() > limits.memory_bytes:
                self.stop()
                raise ValueError(f"{params.field}: compiling its grammar took more than "
                                 f"{limits.memory_bytes / MiB:g} MiB of memory (grammar_compile_memory_bytes)")
            if time.monotonic() > deadline:
                self.stop()
                raise ValueError(f"{params.field}: its grammar did not compile within {limits.timeout_s:g} s "
                                 "(grammar_compile_timeout_s)")
        try:
            kind, value = recv(self.conn)
        except (EOFError, OSError):
            self.stop()
            raise ValueError(f"{params.field}: the grammar engine crashed compiling its grammar") from None
        if kind == "too_large":
            raise ValueError(f"{params.field}: its compiled grammar takes {value / MiB:.0f} MiB, more than "
                             f"the grammar cache's {limits.cache_bytes / MiB:g} MiB (grammar_cache_bytes)")
        if kind == "error":
            raise ValueError(value)
        return value

    def kill(self) -> None:
        """From any thread: end the process (its watching thread then stops it)."""
        if self.process.poll() is None:
            self.process.kill()

    def stop(self) -> None:
        """From its watching thread, which alone uses the socket."""
        self.kill()
        self.process.wait()
        if not self.conn.closed:
            self.conn.close()

    def _rss(self) -> int:
        try:
            return self._memory.memory_info().rss
        except psutil.NoSuchProcess:
            return 0
