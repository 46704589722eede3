"""PipelineFaults: fault containment for one pipeline replica (RayExecutor).

Every call on the step path runs under `stepping()`: one at a time (a real step, or the health
probe's tiny step while the pipeline is idle), and refused at once while a fault is open. The first
failure opens a fault: the engine fails its requests in flight (503 with Retry-After) and drops its
prefix cache (step_or_abort), and a recovery thread waits, up to `recovery_timeout_s`, for every
actor to answer again (Ray restarts a dead one, which reloads its weights), rebuilds what the fault
left (`rebuild`: the routers' placements, the stages' dispatch, a collective group), takes the
restarted actors back and runs a probe step; then the pipeline serves again. An actor gone for good
(out of restarts), or a recovery past its time, leaves the fault open as `broken`: the replica's
health check fails and Serve replaces the replica.

`health()` probes the real step path: while idle, a one-token step through every stage and the
shards it routes to (at most once a second) and a look at every actor; while a step runs, that
step's outcome. Repeated failures log one line with a count (k3ray/repeat_log.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from k3ray.actors.pipeline.protocol import PipelineLost, StageFailure
from k3ray.repeat_log import RepeatLog

logger = logging.getLogger(__name__)

ALIVE = "alive"
RESTARTED = "restarted"  # alive again after a restart Ray made, not taken back yet
REPLACED = "lost, started afresh by the recovery"  # e.g. the stages of a collective hop path
PROBE_EVERY_S = 1.0  # an idle pipeline's probe step, at most this often
RETRY_S = 0.5  # between looks at the actors while recovering


@dataclass
class Fault:
    cause: str
    since: float  # time.monotonic()
    engine_told: bool  # a step for the engine failed or was refused since: it dropped its sequences and prefix cache
    lost: dict[str, str] = field(default_factory=dict)  # actor -> its state at the latest look
    broken: str | None = None  # why the pipeline cannot recover by itself


class PipelineFaults:
    def __init__(self, ping: Callable[[], dict[str, str]], rebuild: Callable[[], bool], probe: Callable[[], None],
                 recovery_timeout_s: float, step_timeout_s: float):
        """ping: every actor's state (ALIVE, RESTARTED, REPLACED, else what is wrong; "dead..." =
        gone for good); rebuild: after a fault, with every actor answering or REPLACED -> whether
        stage caches were lost; probe: one tiny real step (raises StageFailure)."""
        self._ping, self._rebuild, self._probe = ping, rebuild, probe
        self.recovery_timeout_s, self.step_timeout_s = recovery_timeout_s, step_timeout_s
        self._stepping = threading.Lock()  # one call on the step path at a time
        self._state = threading.Lock()  # fault, _fail_next
        self.fault: Fault | None = None
        self._fail_next: str | None = None  # the engine must drop its state before the next step
        self._busy_since: float | None = None
        self._last_ok = 0.0
        self._actors: dict[str, str] = {}  # the latest look at the actors (the recovery's during a fault)
        self._closed = False
        self.recoveries = 0  # faults recovered from
        self._log = RepeatLog(logger)

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """A call on the engine's step path: refused (StageFailure) while a fault is open; a
        StageFailure out of it opens one."""
        self._refuse()
        with self._stepping:
            self._refuse()  # a fault may have opened while this waited
            self._busy_since = time.monotonic()
            try:
                yield
            except StageFailure as e:
                self._open(str(e), engine_told=True, lost_for_good=isinstance(e, PipelineLost))
                raise
            finally:
                self._busy_since = None
            self._last_ok = time.monotonic()

    def health(self) -> dict:
        """{"healthy", "state": serving | recovering | broken, "actors": name -> state, "cause",
        "since_s", "recoveries"}: while idle, a look at every actor and a probe step; while busy, the
        last step's outcome; during a fault, what the recovery last saw."""
        if self.fault is None and self._stepping.acquire(blocking=False):
            try:
                self._actors = actors = self._ping()
                unwell = {name: state for name, state in actors.items() if state != ALIVE}
                if unwell:  # restarted or lost between steps: the caches and placements are rebuilt
                    self._open(f"actors {unwell}", engine_told=False,
                               lost_for_good=any(s.startswith("dead") for s in unwell.values()))
                elif time.monotonic() - self._last_ok >= PROBE_EVERY_S:
                    try:
                        self._probe()
                        self._last_ok = time.monotonic()
                    except StageFailure as e:
                        self._open(f"the health probe step failed: {e}", engine_told=False,
                                   lost_for_good=isinstance(e, PipelineLost))
            finally:
                self._stepping.release()
        fault, busy = self.fault, self._busy_since
        report = {"healthy": True, "state": "serving", "actors": self._actors, "cause": "", "since_s": 0.0,
                  "recoveries": self.recoveries}
        if fault is not None:
            return {**report, "healthy": False, "state": "broken" if fault.broken else "recovering",
                    "cause": fault.broken or fault.cause, "since_s": round(time.monotonic() - fault.since, 1)}
        if busy is not None and time.monotonic() - busy > self.step_timeout_s:
            return {**report, "healthy": False, "cause": f"a step has run for {time.monotonic() - busy:.0f} s"}
        return report

    def close(self) -> None:
        self._closed = True

    def _refuse(self) -> None:
        with self._state:
            if self.fault is not None:
                self.fault.engine_told = True
                fault = self.fault
                message = (f"the pipeline cannot step: {fault.broken}" if fault.broken else
                           f"the pipeline is recovering from: {fault.cause}")
            elif self._fail_next is not None:
                message, self._fail_next = self._fail_next, None
            else:
                return
        self._log.failure(message)
        raise StageFailure(message)

    def _open(self, cause: str, engine_told: bool, lost_for_good: bool = False) -> None:
        with self._state:
            if self.fault is not None:
                self.fault.engine_told |= engine_told
                return
            self.fault = Fault(cause, time.monotonic(), engine_told)
        self._log.failure(f"pipeline fault, recovering: {cause}")
        if lost_for_good:
            self._break(cause)
            return
        threading.Thread(target=self._recover, name="pipeline-recovery", daemon=True).start()

    def _recover(self) -> None:
        fault = self.fault
        assert fault is not None
        deadline = fault.since + self.recovery_timeout_s
        while not self._closed:
            self._actors = states = self._ping()
            fault.lost = {name: state for name, state in states.items() if state not in (ALIVE, RESTARTED, REPLACED)}
            dead = [name for name, state in fault.lost.items() if state.startswith("dead")]
            if dead:
                return self._break(f"{', '.join(dead)} gone for good (out of restarts)")
            if not fault.lost:
                try:
                    with self._stepping:
                        caches_lost = self._rebuild()
                        self._probe()
                    return self._close(fault, caches_lost)
                except PipelineLost as e:
                    return self._break(str(e))
                except Exception as e:  # noqa: BLE001 - another fault meanwhile: look again until the deadline
                    fault.lost = {"rebuild": f"{type(e).__name__}: {e}"}
            if time.monotonic() > deadline:
                return self._break(f"not recovered within {self.recovery_timeout_s:.0f} s: {fault.lost}")
            time.sleep(RETRY_S)

    def _close(self, fault: Fault, caches_lost: bool) -> None:
        with self._state:
            self.fault = None
            self.recoveries += 1
            self._last_ok = time.monotonic()
            if caches_lost and not fault.engine_told:  # nothing failed for the engine yet: the next step does
                self._fail_next = (f"the pipeline recovered from ({fault.cause}) with empty stage caches: "
                                   "requests in flight are lost")
        self._log.ended(f"pipeline recovered in {time.monotonic() - fault.since:.1f} s from: {fault.cause}")

    def _break(self, reason: str) -> None:
        fault = self.fault
        assert fault is not None
        fault.broken = reason
        self._log.ended()
        logger.error("pipeline broken, the replica must be replaced: %s", reason)
