"""Whether a replica's model can step now, known without calling an actor, as the replica's
answer to HAProxy's check of it (Serve's `/-/healthz`, every RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER).

Serve 2.60 answers that check from its periodic `check_health` (every health_check_period_s, 10 s),
and a step on an actor whose node died waits until Ray has noticed, then a second or two more: a
replica that had lost a node stayed in HAProxy's rotation, and `/health` said 200, while requests
got 503. Readiness looks every WATCH_S at the states Ray's GCS holds for the pipeline's actors
(RESTARTING once Ray declares their node dead; named as `k3ray status` names them) and at the
pipeline's open fault (pipeline/faults.py); `answer_checks_with(readiness.now)` makes Serve's answer
in this process also ask it. The replica leaves the rotation after HAProxy's next two checks, and
`/health`, which HAProxy then passes to a replica (serve/haproxy_wrapper.py), names the actors lost. An
actor Ray reports lost makes the pipeline look at once (RayExecutor.health(): a fault opens and
it recovers), also while idle. Serve's periodic check (K3Server.check_health) alone still decides
whether Serve replaces the replica: a pipeline recovering by itself leaves the rotation, it is not
replaced. Called from the replica's constructor (a replica process serves one replica), as
serve/replica_grpc_bind.py is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable

import ray
from ray._private import state as ray_state
from ray.serve._private import replica

from k3ray.actors.cluster.placement_table import actor_table, current_actors, model_roles, state_name

logger = logging.getLogger(__name__)
WATCH_S = 0.1  # between looks at the actors' states in GCS (one read of the job's actor table)
Check = Callable[[], tuple[bool, str]]


class Readiness:
    """`now()` -> (ready, why not): an engine process still running; a Ray pipeline whose actors
    Ray holds ALIVE and with no fault open."""

    def __init__(self, engine: object, executor: object, watch_s: float = WATCH_S) -> None:
        self.engine, self.executor, self.watch_s = engine, executor, watch_s
        self.unavailable: dict[str, str] | None = {}  # actor -> its GCS state, those not ALIVE (None: unread)
        self.roles: dict[str, str] = {}  # the runner's name of an actor -> its name here and in `k3ray status`
        group = ray.util.get_current_placement_group()  # a pipeline replica's own, holding its actors
        if self._runner() is not None and group is not None:
            threading.Thread(target=self._watch, args=(group.id.binary(),), name="k3ray-actor-watch",
                             daemon=True).start()

    def now(self) -> tuple[bool, str]:
        if not getattr(self.engine, "alive", True):
            return False, "the engine process exited"
        lost = self.unavailable
        if lost:
            return False, "actors not alive in Ray: " + ", ".join(f"{name} ({s})" for name, s in sorted(lost.items()))
        fault = getattr(getattr(self._runner(), "faults", None), "fault", None)
        if fault is None:
            return True, ""
        roles = self.roles
        named = f"; not answering: {', '.join(sorted(roles.get(n, n) for n in fault.lost))}" if fault.lost else ""
        return False, f"pipeline {'broken' if fault.broken else 'recovering'}: {fault.broken or fault.cause}{named}"

    async def health(self, full: Callable[[], Awaitable[tuple[bool, str]]]) -> tuple[bool, str]:
        """The app's `/health`: the quick look, and only if that finds nothing wrong `full()`."""
        ok, detail = self.now()
        return await full() if ok else (ok, detail)

    def _runner(self):
        """The Ray executor while it holds its actors (a local executor has none to watch)."""
        executor = self.executor
        return executor if getattr(executor, "started", False) and hasattr(executor, "actors") else None

    def _watch(self, group: bytes) -> None:
        job = ray.get_runtime_context().get_job_id()  # the replica's actors are its job's
        while (runner := self._runner()) is not None:
            try:
                members = current_actors([a for a in actor_table(ray_state.state, job) if a.placement_group_id == group])
                roles = model_roles(members)
                lost = {role: state_name(a) for role, a in roles if a.state != a.ALIVE}
                by_id = {a.actor_id: role for role, a in roles}
                self.roles = {name: by_id[h._actor_id.binary()] for name, h in runner.actors()
                              if h._actor_id.binary() in by_id}
            except Exception as e:  # noqa: BLE001 - a missed look is retried; the pipeline's own checks remain
                if self.unavailable is not None:
                    logger.warning("could not read the pipeline's actor states from GCS (retrying): %s", e)
                self.unavailable = None
                time.sleep(self.watch_s)
                continue
            if lost and not self.unavailable:  # newly lost: the pipeline looks now (a fault opens, and it recovers)
                threading.Thread(target=runner.health, name="k3ray-actor-lost", daemon=True).start()
            self.unavailable = lost
            time.sleep(self.watch_s)


def answer_checks_with(ready: Check) -> None:
    """From now on in this process, Serve's answer to HAProxy's check is also `ready()`'s."""
    serve_check = getattr(replica.Replica._dataplane_health_check, "serve_check",
                          replica.Replica._dataplane_health_check)

    async def check(self) -> tuple[bool, str]:
        healthy, message = await serve_check(self)
        if not healthy:
            return healthy, message
        ok, detail = ready()
        return (True, message) if ok else (False, f"UNHEALTHY: {detail}")

    check.serve_check = serve_check  # a second call wraps Serve's own method again
    replica.Replica._dataplane_health_check = check
