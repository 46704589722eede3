"""Restartable: the base of a pipeline replica's actors (stages, routers, expert shards, the vision
encoder). Ray restarts a dead actor in a fresh process that has lost what it held: a stage its
caches, a shard its expert replicas, a router its placement and load counts. Such an actor says
`restarted` (in ready(), and a stage refuses to step) until the runner, having rebuilt around it,
calls `adopt()` (pipeline_faults.py)."""

from __future__ import annotations

import ray


class Restartable:
    _adopted = False  # per process: a restart starts a fresh instance

    @property
    def restarted(self) -> bool:
        """Ray restarted this actor and the runner has not taken it back yet."""
        if not self._adopted and not ray.get_runtime_context().was_current_actor_reconstructed:
            self._adopted = True  # the first process: nothing was lost
        return not self._adopted

    def adopt(self) -> None:
        self._adopted = True
