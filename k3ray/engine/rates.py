"""Work rates the engine measures on itself, for a server's wait estimates (actors/openai/admission.py):
tokens computed per second of the steps that computed them. Idle time between steps never counts,
and an aborted request's computed tokens count as the work they were.

    rate = Rate()
    rate.observe(tokens=512, seconds=0.25)   # one step's prompt tokens of one lane, and its time
    rate.per_s                               # ~2048.0; None before any step computed such tokens
"""

from __future__ import annotations

import math

MEMORY_S = 5.0  # older steps fade with this time constant (of step time, not wall time)


class Rate:
    def __init__(self, memory_s: float = MEMORY_S) -> None:
        assert memory_s > 0
        self.memory_s = memory_s
        self._tokens = 0.0  # decayed
        self._seconds = 0.0  # decayed

    def observe(self, tokens: int, seconds: float) -> None:
        """One step that computed `tokens` of this kind in `seconds` (steps without any are skipped)."""
        if tokens <= 0 or seconds <= 0:
            return
        decay = math.exp(-seconds / self.memory_s)
        self._tokens = self._tokens * decay + tokens
        self._seconds = self._seconds * decay + seconds

    @property
    def per_s(self) -> float | None:
        return self._tokens / self._seconds if self._seconds > 0 else None
