"""RepeatLog: a failure that repeats (every request of an outage, every step refused while a pipeline
recovers) is logged once when it starts, then as one line with its count when another takes its
place, when it ends, or every `every_s` seconds while it lasts: never a traceback per occurrence.

    log = RepeatLog(logger)
    log.failure(str(error))      # first time: a warning; again: counted
    log.ended("recovered")       # "... repeated 136 times in 300 s", then "recovered"
"""

from __future__ import annotations

import logging
import threading
import time


class RepeatLog:
    def __init__(self, logger: logging.Logger, every_s: float = 60.0):
        self.logger, self.every_s = logger, every_s
        self._lock = threading.Lock()
        self._message: str | None = None
        self._count = 0  # occurrences of _message since it was last logged
        self._since = self._logged = 0.0

    def failure(self, message: str) -> None:
        """One occurrence: logged when it differs from the last one, else counted."""
        with self._lock:
            now = time.monotonic()
            if message == self._message:
                self._count += 1
                if now - self._logged >= self.every_s:
                    self._summary(now, "still failing")
                return
            self._summary(now, "repeated")
            self.logger.warning("%s", message)
            self._message, self._count, self._since, self._logged = message, 0, now, now

    def ended(self, message: str | None = None) -> None:
        """The failure is over: its count, then `message` (a warning too: it closes what they opened)."""
        with self._lock:
            self._summary(time.monotonic(), "repeated")
            self._message = None
            if message:
                self.logger.warning("%s", message)

    def _summary(self, now: float, what: str) -> None:
        if self._message is not None and self._count:
            self.logger.warning("%s %d more times in %.0f s: %s", what, self._count, now - self._since, self._message)
            self._count, self._logged = 0, now
