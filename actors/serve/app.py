"""The Ray Serve deployment: one replica = one model pipeline behind the OpenAI routes.

    k3ray serve --model /path/to/ckpt --max-replicas 2 --print-config > app.yaml; serve run app.yaml
    serve.run(build_app({"model": {"model": "/path/to/ckpt"}, "parallel": {"pipeline": 2}}))

`build_app(args)` is the Serve import path; args are ServeArgs' nested groups. A replica with
pipeline or expert_parallel > 1 declares its placement-group bundles up front, so its stages,
routers and expert shards are reserved, started and released together with it. An undistributed
model runs in an engine process of the replica's own (EngineClient; `engine.engine_process=False`:
in the replica's process), so the model's steps and Serve's request handling do not take turns on
one GIL.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os

import ray
from ray import serve
from ray.serve import Application
from ray.serve._private import constants as serve_constants
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from k3ray.actors.openai.admission import Admission, AdmissionLimits
from k3ray.actors.openai.routes import build_openai_app
from k3ray.actors.openai.serving import OpenAIServing
from k3ray.actors.serve.autoscaling import serve_autoscaling_config
from k3ray.actors.serve.config import DisaggregationSettings, ServeArgs
from k3ray.actors.serve.disaggregation import DisaggregatedEngine
from k3ray.actors.serve.engine import context_limit_note, engine_config, start_replica_engine
from k3ray.actors.serve.ingress_routing import IngressRequestRouter
from k3ray.actors.serve.load_signals import LoadSignals
from k3ray.actors.serve.metrics import ServeMetrics
from k3ray.actors.serve.metrics_listener import MetricsListener, runtime_dir
from k3ray.actors.serve.prefill_server import K3Prefill
from k3ray.actors.serve.replica_bundles import replica_bundles
from k3ray.actors.serve.replica_grpc_bind import bind_replica_grpc_to
from k3ray.actors.serve.replica_readiness import Readiness, answer_checks_with
from k3ray.actors.serve.request_routing import PREFIXES_STAT, PrefixAffinityRequestRouter
from k3ray.engine.process.engine_client import EngineClient

logger = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.5


@serve.deployment(name="K3Server")
@serve.ingress()
class K3Server:
    async def __init__(self, args: dict, prefill: DeploymentHandle | None = None) -> None:
        """`prefill`: the K3Prefill pool of a disaggregated app (this replica then decodes only)."""
        bind_replica_grpc_to(ray.util.get_node_ip_address())  # Serve starts that server once this returns
        self.args = ServeArgs.model_validate(args)
        placement_group = ray.util.get_current_placement_group() if self.args.distributed else None
        self.engine, self.executor, tokenizer = await start_replica_engine(self.args, placement_group)
        self.disaggregated = None if prefill is None else DisaggregatedEngine(
            self.engine, prefill, self.args.engine.block_size, self.args.disaggregation.handoff_attempts,
            self.engine.info.model_config.media_placeholder_token_id, self.args.autoscaling.look_back_period_s)
        expert_load = getattr(self.executor, "expert_load", None)
        self.metrics = ServeMetrics(self.args.server.served_model_name, self.engine.get_stats, expert_load)
        # under k3ray's HAProxy, /metrics is answered outside the request queue (serve/metrics_listener.py)
        self.metrics_listener = None if runtime_dir() is None else \
            MetricsListener(self.metrics.render_now, serve.get_replica_context().app_name)
        server = self.args.server
        self.load_signals = LoadSignals(window_s=self.args.autoscaling.look_back_period_s)
        info = self.engine.info
        limits = AdmissionLimits(server.max_queued_tokens or None, server.max_queue_wait_s or None,
                                 server.retry_after_s, info.long_prompt_tokens, info.prefill_chunk_tokens)
        admission = Admission(limits, self.engine.get_stats, on_started=self.load_signals.observe_ttft)
        self.serving = OpenAIServing(self.disaggregated or self.engine, tokenizer, server.served_model_name,
                                     self.metrics, admission)
        logger.info("K3Server ready: %s, max_model_len %d, %s", self.args.server.served_model_name,
                    self.engine.info.max_model_len, type(self.executor or self.engine).__name__)
        note = context_limit_note(self.args, self.engine.info)
        if note is not None:
            logger.warning(note)
        # HAProxy's check of this replica, and /health, say at once whether the model can step
        self.readiness = Readiness(self.engine, self.executor)
        answer_checks_with(self.readiness.now)

    def __serve_build_asgi_app__(self):
        health = functools.partial(self.readiness.health, self.health)  # the quick look first
        return build_openai_app(self.serving, metrics=self.metrics, health=health,
                                api_key=self.args.server.api_key or os.environ.get("K3RAY_API_KEY") or None,
                                max_body_bytes=self.args.server.max_body_bytes,
                                retry_after_s=self.args.server.retry_after_s)

    async def health(self) -> tuple[bool, str]:
        """Whether the model can step now: a local model while the replica answers (and its engine
        process lives); a Ray pipeline by a probe step through it while idle, its last step while
        busy (RayExecutor.health), naming the actors lost while it recovers."""
        ok, detail, _ = await self._health()
        return ok, detail

    async def check_health(self) -> None:
        """Serve's periodic probe: a pipeline that cannot step and will not recover by itself (an
        actor gone for good, a recovery past its time, a stuck step) makes Serve replace the whole
        replica; one recovering (its actors restarting, on other nodes after a node loss) answers
        503 meanwhile, but stays."""
        ok, detail, recovering = await self._health()
        if not ok and not recovering:
            raise RuntimeError(detail)

    async def _health(self) -> tuple[bool, str, bool]:
        if isinstance(self.engine, EngineClient):
            return self.engine.alive, f"engine process exit code {self.engine.process.poll()}", False
        report = await asyncio.to_thread(self.executor.health)
        bad = {name: state for name, state in report["actors"].items() if state != "alive"}
        state = report.get("state", "serving")
        lost = "".join(f"; node {node[:8]} lost with {', '.join(names)}"
                       for node, names in report["lost_nodes"].items())
        detail = f"pipeline {state}: {report.get('cause') or 'a node was lost'}; actors {bad}{lost}"
        return report["healthy"], detail, state == "recovering"

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's hook: this replica's load for the llm autoscaling policy (serve/load_signals.py)."""
        itl = None if self.disaggregated is None else self.disaggregated.itl.recent()
        return self.load_signals.report(self.engine.get_stats(), self.serving.admission.queued_tokens, itl)

    def handoff_stats(self) -> dict | None:
        """A decode replica's handoffs so far (serve/disaggregation.py HandoffStats); None: colocated."""
        return None if self.disaggregated is None else self.disaggregated.stats.as_dict()

    def record_routing_stats(self) -> dict:
        """Serve's hook (pulled every routing.routing_stats_period_s): the prefixes this replica's
        cache can resume from, for prefix-affinity routing."""
        return {PREFIXES_STAT: self.engine.get_stats().cached_prefixes}

    async def __del__(self) -> None:
        """Serve stops the replica: end its requests, then its engine process or model actors."""
        if getattr(self, "metrics_listener", None) is not None:
            self.metrics_listener.close()
        if hasattr(self, "engine"):
            await self.engine.shutdown()
        if getattr(self, "executor", None) is not None:  # None: the engine process held the model
            await asyncio.to_thread(self.executor.shutdown)


def deployment_options(args: ServeArgs) -> dict:
    """Options for `K3Server.options(...)`; args must be resolved (a checkpoint path is needed to
    size a distributed replica's placement group)."""
    scaling, server, parallel = args.autoscaling, args.server, args.parallel
    if args.disaggregation.enabled:
        autoscaling = serve_autoscaling_config(scaling, "decode", itl_target_ms=args.disaggregation.autoscale_itl_ms,
                                               running_per_replica=args.engine.max_num_seqs)
    else:
        autoscaling = serve_autoscaling_config(scaling)
    options = {
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": server.max_ongoing_requests or args.engine.max_num_seqs,
        "max_queued_requests": server.max_queued_requests,
        "ray_actor_options": {"num_cpus": parallel.replica_cpus, "num_gpus": parallel.replica_gpus},
        # a stopping replica counts its requests in flight this often (Serve: every 2 s), so an
        # idle one stops at once and a busy one as soon as its last request ends
        "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
    }
    if server.max_queued_requests >= 0:
        options["backpressure_config"] = BackpressureConfig(status_code=429, retry_after_s=server.retry_after_s)
    if affinity_routing(args):
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRequestRouter,
            request_router_kwargs={"max_imbalance": args.routing.affinity_max_imbalance,
                                   "snapshot_interval": engine_config(args).snapshot_interval},
            request_routing_stats_period_s=args.routing.routing_stats_period_s)
    if args.distributed:
        options["placement_group_bundles"] = replica_bundles(args)
        options["placement_group_strategy"] = parallel.placement_strategy
    return options


def prefill_deployment_options(args: ServeArgs) -> dict:
    """Options for `K3Prefill.options(...)`: the prefill pool of a disaggregated app, sized by its own
    replica bounds on queued prompt tokens and TTFT, routed by prefix affinity (the decode replica
    passes the prompt's block hashes), each replica laid out as a decode replica is."""
    d = args.disaggregation
    scaling = args.autoscaling.model_copy(update={"min_replicas": d.prefill_replicas, "initial_replicas": None,
                                                  "max_replicas": d.prefill_max_replicas or d.prefill_replicas})
    options = {k: v for k, v in deployment_options(args.model_copy(update={
        "autoscaling": scaling, "disaggregation": DisaggregationSettings()})).items()
        if k not in ("request_router_config", "backpressure_config")}
    options["autoscaling_config"] = serve_autoscaling_config(scaling, "prefill")
    options["max_queued_requests"] = -1  # decode replicas admit; a prefill waits its turn in the engine
    if args.routing.request_router == "affinity" and scaling.max_replicas > 1:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRequestRouter,
            request_router_kwargs={"max_imbalance": args.routing.affinity_max_imbalance,
                                   "snapshot_interval": engine_config(args).snapshot_interval},
            request_routing_stats_period_s=args.routing.routing_stats_period_s)
    return options


def build_app(args: dict) -> Application:
    """Serve app builder (import path `k3ray.actors.serve.app:build_app`)."""
    resolved = ServeArgs.model_validate(dict(args or {})).resolved()
    prefill = None
    if resolved.disaggregation.enabled:
        prefill = K3Prefill.options(**prefill_deployment_options(resolved)).bind(resolved.model_dump())
    app = K3Server.options(**deployment_options(resolved)).bind(resolved.model_dump(), prefill)
    if not affinity_routing(resolved):
        return app
    # HAProxy asks this deployment for each request's replica (Serve's own hook for it)
    router = IngressRequestRouter.bind(app, resolved.model.tokenizer or resolved.model.model, resolved.engine.block_size)
    return app._with_ingress_request_router(router)


def affinity_routing(args: ServeArgs) -> bool:
    """Prefix-affinity routing applies: asked for, more than one replica possible, and HAProxy in
    front (Serve's proxy passes the replicas no request body to route on)."""
    return args.routing.request_router == "affinity" and args.autoscaling.max_replicas > 1 and \
        serve_constants.RAY_SERVE_ENABLE_HA_PROXY  # read now: a driver sets it after importing this module
