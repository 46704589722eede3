"""Autoscaling whole model pipelines on LLM signals: a Serve custom autoscaling policy that sizes
the replica count from what each replica reports (serve/load_signals.py), not from its request count.

    desired = max(queued prompt tokens / queued_tokens per replica,
                  sum of cache usage / CACHE_USAGE_TARGET,
                  replicas x min(TTFT p90 / target, MAX_STEP)   when TTFT is over its target,
                  replicas                                      when it is within HOLD of it)

A disaggregated app's pools (serve/disaggregation.py) each have their own terms (`role`): prefill
replicas on queued prompt tokens and TTFT; decode replicas on cache usage, sequences running or
waiting for a slot per replica (running_per_replica) and inter-token latency p90 over its target, as
TTFT above.

Queued tokens and cache usage scale in proportion (the same work spread over fewer replicas must
still fit); TTFT, which is not linear in replicas, only pushes up, and holds the count while it is
near its target so an idle-looking queue does not remove the replica keeping TTFT down. Serve
wraps the policy with upscale_delay_s / downscale_delay_s (against flapping), the scaling factors
and min/max_replicas. A replica is a whole pipeline in one placement group (its stages, routers and
expert shards as bundles); Ray reserves a placement group's bundles all at once or not at all, so an
added replica starts with every bundle or stays pending without any.
"""

from __future__ import annotations

from typing import Any

from k3ray.actors.serve import load_signals
from k3ray.actors.serve.config import AutoscalingSettings

POLICY = "k3ray.actors.serve.autoscaling:LLMAutoscalingPolicy"
CACHE_USAGE_TARGET = 0.9  # fraction of MLA blocks / KDA slots in use a replica may run at
MAX_STEP = 2.0  # at most this many times the replicas per decision on TTFT alone
HOLD = 0.5  # TTFT p90 above this fraction of its target keeps the replicas there are
STATE_KEY = "k3ray_llm"  # policy_state entry: the last decision's terms
# the terms each kind of replica is sized on
ROLE_TERMS = {"colocated": ("queued_tokens", "cache_usage", "ttft"), "prefill": ("queued_tokens", "ttft"),
              "decode": ("cache_usage", "running", "itl")}


class LLMAutoscalingPolicy:
    """Serve instantiates it once per deployment with policy_kwargs; called every control loop."""

    def __init__(self, ttft_target_ms: float, queued_tokens_per_replica: int,
                 cache_usage_target: float = CACHE_USAGE_TARGET, role: str = "colocated",
                 itl_target_ms: float = 500.0, running_per_replica: int = 64) -> None:
        if ttft_target_ms <= 0 or queued_tokens_per_replica < 1 or not 0 < cache_usage_target <= 1:
            raise ValueError(f"ttft_target_ms {ttft_target_ms} must be > 0, queued_tokens_per_replica "
                             f"{queued_tokens_per_replica} >= 1, cache_usage_target {cache_usage_target} in (0, 1]")
        if role not in ROLE_TERMS or itl_target_ms <= 0 or running_per_replica < 1:
            raise ValueError(f"role {role!r} must be one of {sorted(ROLE_TERMS)}, itl_target_ms {itl_target_ms} > 0, "
                             f"running_per_replica {running_per_replica} >= 1")
        self.ttft_target_s = ttft_target_ms / 1000
        self.queued_tokens_per_replica = queued_tokens_per_replica
        self.cache_usage_target = cache_usage_target
        self.role = role
        self.itl_target_s = itl_target_ms / 1000
        self.running_per_replica = running_per_replica

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        """(desired replicas, policy state) from a ray.serve.config.AutoscalingContext."""
        metrics = ctx.aggregated_metrics or {}
        reporting = metrics.get(load_signals.CACHE_USAGE, {})
        state = dict(ctx.policy_state)
        if not reporting:  # no replica has reported yet: keep the target
            state[STATE_KEY] = {"reason": "no reports"}
            return ctx.target_num_replicas, state
        replicas = max(ctx.current_num_replicas, 1)

        def total(key: str) -> float:
            return sum(metrics.get(key, {}).values())

        terms = {
            "queued_tokens": lambda: total(load_signals.QUEUED_TOKENS) / self.queued_tokens_per_replica,
            "cache_usage": lambda: sum(reporting.values()) / self.cache_usage_target,
            # waiting ones too: running sequences alone never ask for more replicas than there are
            "running": lambda: (total(load_signals.RUNNING) + total(load_signals.WAITING)) / self.running_per_replica,
            "ttft": lambda: self._latency_term(metrics, load_signals.TTFT_P90, load_signals.TTFT_COUNT,
                                               self.ttft_target_s, replicas),
            "itl": lambda: self._latency_term(metrics, load_signals.ITL_P90, load_signals.ITL_COUNT,
                                              self.itl_target_s, replicas),
        }
        terms = {name: terms[name]() for name in ROLE_TERMS[self.role]}
        reason = max(terms, key=terms.get)
        state[STATE_KEY] = {"reason": reason, **terms}
        return terms[reason], state

    def _latency_term(self, metrics: dict, p90_key: str, count_key: str, target_s: float, replicas: int) -> float:
        """Replicas a latency (TTFT, ITL) asks for: more when over the target, these while within HOLD of
        it, else none."""
        counts = metrics.get(count_key, {})
        p90s = [p90 for replica, p90 in metrics.get(p90_key, {}).items() if counts.get(replica, 0) > 0]
        if not p90s:
            return 0.0
        ratio = sum(p90s) / len(p90s) / target_s
        if ratio > 1:
            return replicas * min(ratio, MAX_STEP)
        return float(replicas) if ratio > HOLD else 0.0


def serve_autoscaling_config(scaling: AutoscalingSettings, role: str = "colocated",
                             **role_kwargs: Any) -> dict[str, Any]:
    """Serve's autoscaling_config of the settings: their Serve fields, and the LLM policy when chosen
    (with the terms of `role`, and its own kwargs: itl_target_ms, running_per_replica)."""
    own = {"autoscale_policy", "autoscale_ttft_ms", "autoscale_queued_tokens"}
    config = scaling.model_dump(exclude_none=True, exclude=own)
    if scaling.autoscale_policy == "llm":
        kwargs = {"ttft_target_ms": scaling.autoscale_ttft_ms,
                  "queued_tokens_per_replica": scaling.autoscale_queued_tokens}
        if role != "colocated":
            kwargs.update(role=role, **role_kwargs)
        config["policy"] = {"policy_function": POLICY, "policy_kwargs": kwargs}
    return config
