"""Eval progress in tokens, so a long cell moves while it runs (a 32K prompt's prefill, not "0/1").

The bar's total is each pending cell's prompt and generated tokens. While cells run, it follows the
target's count of tokens computed (`Target.tokens_computed`: the engine's counters in process, the
server's /metrics against an endpoint, prefill chunks included), never past the cells started; a
finished cell counts in full (a prefix-cache hit computes fewer tokens than it holds). A target
without a count moves a cell at a time.

    with TokenProgress(cell_tokens, tokens_computed(target), enabled=True) as progress:
        progress.started(key); ...; progress.finished(key)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from tqdm import tqdm

from k3ray.evals.tasks import Cell, Task

POLL_S = 0.5  # how often the target's token count is read


def cell_tokens(task: Task, cell: Cell, reserve_generation: bool) -> int:
    """Tokens one cell computes: its prompt and answer (text cells; a media cell: its answer)."""
    if task.unit != "tokens":
        return task.max_tokens
    return cell.length + (0 if reserve_generation else task.max_tokens)


class TokenProgress:
    def __init__(self, cell_tokens: Mapping[str, int], counter: Callable[[], int | None] | None, *,
                 enabled: bool = True, on_update: Callable[[int, int, int], None] | None = None) -> None:
        self.cell_tokens = dict(cell_tokens)
        self.counter = counter
        self.on_update = on_update  # (tokens shown, total, cells done): for tests and other front ends
        self.total = sum(self.cell_tokens.values())
        self.bar = tqdm(total=self.total, disable=not enabled, desc="eval", unit="tok")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._done = self._in_flight = self._cells_done = 0  # tokens of finished / started cells
        self._last = 0
        self._computed0 = self._read()
        self._base = self._base_computed = 0  # shown = base + (computed - base_computed), capped
        self._poller = threading.Thread(target=self._poll, name="eval-progress", daemon=True)

    def __enter__(self) -> TokenProgress:
        self._show()
        if self.counter is not None:
            self._poller.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._poller.is_alive():
            self._poller.join()
        self.bar.close()

    def started(self, key: str) -> None:
        with self._lock:
            self._in_flight += self.cell_tokens[key]
        self._show()

    def finished(self, key: str) -> None:
        computed = self._computed()
        with self._lock:
            tokens = self.cell_tokens[key]
            self._in_flight -= tokens
            self._done += tokens
            self._cells_done += 1
            if self._base + computed - self._base_computed < self._done:  # the cell counts in full
                self._base, self._base_computed = self._done, computed
        self._show(computed)

    def _read(self) -> int:
        value = self.counter() if self.counter is not None else None  # outside the lock: an HTTP call
        if value is not None:
            self._last = value
        return self._last

    def _computed(self) -> int:
        return self._read() - self._computed0

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            self._show()

    def _show(self, computed: int | None = None) -> None:
        computed = self._computed() if computed is None else computed
        with self._lock:
            shown = min(self._done + self._in_flight, self._base + computed - self._base_computed)
            shown = max(shown, self.bar.n)  # never backwards
            self.bar.set_postfix_str(f"cells {self._cells_done}/{len(self.cell_tokens)}", refresh=False)
            self.bar.update(shown - self.bar.n)
            if self.on_update is not None:
                self.on_update(shown, self.total, self._cells_done)
