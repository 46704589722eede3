"""The settings of `k3ray serve`, defined once. ServeArgs is the app's args (the `args:` of a Serve
config YAML) in groups; LaunchSettings is where `k3ray serve` itself runs the app (Ray, the HTTP
port). The flags and their help (serve/flags.py) and the Serve config YAML (serve/yaml_config.py) are
generated from these fields. Every group is strict and frozen: an unknown key is an error, so a
typo never goes unnoticed."""

from __future__ import annotations

import ipaddress
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from k3ray.actors.openai.limits import DEFAULT_MAX_BODY_BYTES
from k3ray.actors.pipeline.config import (
    DEFAULT_MOE_DISPATCH,
    DEFAULT_REBALANCE_STEPS,
    DEFAULT_REDUNDANT_EXPERTS,
    MoEDispatchMode,
    ParallelConfig,
)
from k3ray.default_model import checkpoint_dir

APP_NAME = "k3ray"
IMPORT_PATH = "k3ray.actors.serve.app:build_app"  # the Serve app builder
Ingress = Literal["haproxy", "proxy"]
DEFAULT_INGRESS: Ingress = "haproxy"
ProxyLocation = Literal["EveryNode", "HeadOnly"]  # Serve's choices that serve HTTP
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(Settings):
    """The HTTP side: the model id, auth, body size, and admission (at most max_ongoing_requests
    per replica, then a queue bounded by requests, prompt tokens and expected wait, then 429)."""

    served_model_name: str | None = Field(
        None, description="the model id clients send; null = the checkpoint folder name")
    api_key: str | None = Field(
        None, description="require `Authorization: Bearer <key>`; null = $K3RAY_API_KEY (none if unset)")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, description="larger request bodies get 413")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="requests per replica at once; null = engine max_num_seqs")
    max_queued_requests: int = Field(256, ge=-1, description="requests waiting for a replica, then 429; -1 = no bound")
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After of a 429")
    max_queued_tokens: int = Field(
        65536, ge=0, description="prompt tokens a replica still has to prefill for short prompts, then 429 (long "
        "prompts have a lane of their own); 0 = no bound")
    max_queue_wait_s: float = Field(
        30.0, ge=0, description="expected wait in a replica's lane (the prompt tokens ahead / the engine's measured "
        "prefill rate) beyond which requests get 429 with Retry-After; 0 = no bound")


class ModelSettings(Settings):
    """The checkpoint, its dtype and tokenizer."""

    model: str | None = Field(
        None, description="checkpoint directory, visible on every node; null = the tiny K3, made on first use")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights and activations")
    device: str = Field(
        "auto", description="where an undistributed replica's model, caches and sampling run: auto (CUDA when the "
        "replica has a GPU, see --replica-gpus), cpu, cuda, cuda:N; pipeline and expert actors use the GPUs Ray gives "
        "them (--stage-gpus, --shard-gpus)")
    tokenizer: str | None = Field(
        None, description="tokenizer directory, for a checkpoint that holds none; null = the checkpoint's own")


class ParallelSettings(Settings):
    """One replica = one model pipeline; pipeline or expert_parallel > 1 runs stages, routers and
    expert shards as Ray actors in the replica's placement group (its own bundle first)."""

    pipeline: int = Field(1, ge=1, description="pipeline stages per replica (> 1: Ray actors)")
    expert_parallel: int = Field(1, ge=1, description="expert shards per stage (> 1: Ray actors)")
    replica_cpus: float = Field(1.0, gt=0, description="CPUs of the replica itself")
    stage_cpus: float = Field(1.0, gt=0, description="CPUs per pipeline-stage actor")
    shard_cpus: float = Field(1.0, gt=0, description="CPUs per expert-shard actor")
    router_cpus: float = Field(0.5, gt=0, description="CPUs per stage's router actor")
    stage_gpus: float = Field(0.0, ge=0, description="GPUs per pipeline-stage actor (0 on CPU clusters)")
    shard_gpus: float = Field(0.0, ge=0, description="GPUs per expert-shard actor")
    replica_gpus: float = Field(0.0, ge=0, description="GPUs of the replica itself (a local, undistributed model)")
    vision_cpus: float = Field(0.5, gt=0, description="CPUs of a pipeline replica's VisionEncoder actor")
    vision_gpus: float = Field(0.0, ge=0, description="GPUs of a pipeline replica's VisionEncoder actor")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how the replica's placement group spreads over nodes")
    stage_transport: Literal["auto", "host", "gloo"] = Field(
        "auto", description="hidden states between pipeline stages: auto = GPU to GPU over NCCL when every stage has "
        "its own GPU, else host memory; host = always host memory; gloo = Ray's GLOO transport (CPU stages)")
    handoff_transport: Literal["auto", "object-store", "nixl"] = Field(
        "auto", description="disaggregated pipeline replicas: a handoff's caches, prefill stage to decode stage: auto = "
        "Ray's NIXL tensor transport when every stage computes on a GPU and has nixl, else the object store; "
        "object-store = always; nixl = NIXL on any device (pip install 'k3ray[nixl]')")
    moe_dispatch: MoEDispatchMode = Field(
        DEFAULT_MOE_DISPATCH, description="MoE rows from each stage straight to its shards by actor calls (direct), through "
        "the stage's router actor (router) or through a Ray Compiled Graph (compiled)")
    redundant_experts: int = Field(
        DEFAULT_REDUNDANT_EXPERTS, ge=0, description="with expert parallelism: replicas of the hottest experts each "
        "shard holds per MoE layer, placed by the router from the measured load")
    rebalance_steps: int = Field(
        DEFAULT_REBALANCE_STEPS, ge=0, description="steps between the router's expert rebalancing; 0 = never")


class EngineSettings(Settings):
    """The replica's engine: batching, the cache, speculative decoding, its process."""

    max_num_seqs: int = Field(64, ge=1, description="sequences per batch")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step")
    max_model_len: int | None = Field(
        None, ge=2, description="context limit; null = what the cache holds less the long-context reserve")
    block_size: int = Field(16, ge=1, description="MLA cache block size (tokens)")
    cache_memory_mb: float | None = Field(
        None, gt=0, description="cache memory per replica; null = the engine's default")
    long_prefill_token_threshold: int = Field(
        16384, ge=1, description="longer prompts are long: one prefills at a time, with at most half of each step's "
        "tokens while shorter requests wait, in their own admission lane")
    long_context_reserve: int | None = Field(
        None, ge=0, description="cache tokens long sequences leave to shorter ones; null = a 16th of the cache "
        "once it holds four long prompts")
    enable_prefix_caching: bool = Field(True, description="reuse the cache of a shared prompt prefix")
    speculative_ngram: int = Field(0, ge=0, description="draft tokens per step by n-gram lookup; 0 = off")
    enforce_eager: bool = Field(False, description="no CUDA graphs: decode steps run eagerly (on the CPU they always do)")
    seed: int = Field(0, description="sampling seed of requests without their own")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads of the replica's model; null = 1 on a machine with <= 4 cores, "
        "else torch's default")
    engine_process: bool = Field(True, description="run an undistributed model's engine in its own process (no GIL "
                                 "shared with HTTP work)")
    max_schema_bytes: int = Field(1024**2, ge=1, description="largest response_format JSON schema (its JSON text); "
                                  "a larger one answers 400")
    grammar_compile_timeout_s: float = Field(30.0, gt=0, description="a response_format grammar compiles (in a "
                                             "worker process, off the engine's step) within this, else 400")
    grammar_compile_memory_mb: float = Field(1024.0, gt=0, description="memory a grammar compile may take (its "
                                             "worker's growth), else 400")
    grammar_cache_mb: float = Field(256.0, gt=0, description="compiled grammars kept per replica (least recently "
                                    "used go first); a larger grammar answers 400")
    grammar_compile_workers: int = Field(2, ge=1, description="grammar worker processes per replica (compiles at once)")


class AutoscalingSettings(Settings):
    """Serve's autoscaling: whole pipelines are added and removed, on LLM signals (queued prompt tokens,
    cache usage, time to first token) or on ongoing requests."""

    autoscale_policy: Literal["llm", "ongoing-requests"] = Field(
        "llm", description="what sizes the replicas: queued prompt tokens, cache usage and TTFT per replica "
        "(llm, actors/serve/autoscaling.py), or Serve's ongoing requests per replica (ongoing-requests)")
    autoscale_ttft_ms: float = Field(
        2000.0, gt=0, description="llm policy: p90 time to first token (in the replica) it adds replicas to stay under")
    autoscale_queued_tokens: int = Field(
        16384, ge=1, description="llm policy: prompt tokens waiting per replica it sizes the replicas for")
    min_replicas: int = Field(1, ge=0, description="fewest replicas")
    max_replicas: int = Field(1, ge=1, description="most replicas (= min_replicas: no autoscaling)")
    initial_replicas: int | None = Field(None, ge=0, description="replicas at start; null = min_replicas")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="ongoing-requests policy: ongoing requests per replica it aims at")
    upscale_delay_s: float = Field(30.0, ge=0, description="load above target this long adds replicas")
    downscale_delay_s: float = Field(600.0, ge=0, description="load below target this long removes replicas")
    metrics_interval_s: float = Field(10.0, gt=0, description="how often replicas report their load")
    look_back_period_s: float = Field(30.0, gt=0, description="window the reported load is averaged over")

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas={self.initial_replicas} is outside [min_replicas, max_replicas]")
        return self


class RoutingSettings(Settings):
    """Which replica a request goes to: the one whose prefix cache holds most of its prompt
    (affinity), or the least loaded (Serve's default)."""

    request_router: Literal["affinity", "default"] = Field(
        "affinity", description="with several replicas behind the haproxy ingress: affinity sends a request to the "
        "replica whose prefix cache holds the longest part of its prompt (a conversation's turns to one replica), "
        "unless that replica is overloaded; default: by load alone (Serve's proxy ingress always routes so)")
    affinity_max_imbalance: int = Field(
        4, ge=0, description="affinity: requests the cache-holding replica may have beyond the least-loaded one "
        "before a request goes to the least loaded instead")
    routing_stats_period_s: float = Field(
        1.0, gt=0, description="affinity: how often each replica reports the prefixes its cache can resume from")


class MediaSettings(Settings):
    """Images and videos in chat requests (a checkpoint with a vision tower)."""

    allow_remote_media_urls: bool = Field(False, description="fetch http(s) image/video URLs (off: data: URLs only)")
    max_media_bytes: int | None = Field(None, ge=1, description="bytes per media item; null = the checkpoint's "
                                        "media config")
    max_media_per_prompt: int = Field(128, ge=0, description="media items per prompt")
    max_request_pixels: int | None = Field(
        None, ge=1, description="decoded pixels per request, summed over all its images and video frames (each "
        "checked before it is decoded); null = the checkpoint's media config (2^28)")
    media_fetch_timeout_s: float = Field(10.0, gt=0, description="per remote media URL")
    allowed_local_media_path: str | None = Field(
        None, description="a folder whose files chat requests may name as file:// image/video URLs; null = none may")


class DisaggregationSettings(Settings):
    """Prefill/decode disaggregation: prompts run on a pool of prefill replicas (K3Prefill), which hand
    each request's caches to the decode replica (K3Server, the pool the autoscaling group sizes) that
    streams its output; each pool is autoscaled on its own signals."""

    prefill_replicas: int = Field(
        0, ge=0, description="prefill replicas at start (also the fewest); 0 = off: each replica runs prompts "
        "and decodes")
    prefill_max_replicas: int | None = Field(
        None, ge=1, description="most prefill replicas (autoscaled on queued prompt tokens and TTFT); null = "
        "prefill_replicas")
    handoff_attempts: int = Field(
        2, ge=1, description="prefills a request gets before a 503 when a prefill replica is lost or a handoff "
        "cannot be written")
    autoscale_itl_ms: float = Field(
        500.0, gt=0, description="llm policy, decode pool: p90 inter-token latency it adds decode replicas to "
        "stay under")

    @model_validator(mode="after")
    def _check(self) -> DisaggregationSettings:
        if self.prefill_max_replicas is not None and not 1 <= self.prefill_replicas <= self.prefill_max_replicas:
            raise ValueError(f"prefill_max_replicas={self.prefill_max_replicas} needs 1 <= prefill_replicas "
                             f"(now {self.prefill_replicas}) <= it")
        return self

    @property
    def enabled(self) -> bool:
        return self.prefill_replicas > 0


class ServeArgs(Settings):
    """Every setting of one deployed model, in groups; a group or field left out takes its default."""

    server: ServerSettings = Field(default_factory=ServerSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    parallel: ParallelSettings = Field(default_factory=ParallelSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    media: MediaSettings = Field(default_factory=MediaSettings)
    disaggregation: DisaggregationSettings = Field(default_factory=DisaggregationSettings)

    @property
    def distributed(self) -> bool:
        """Whether the model runs as Ray actors (pipeline stages / expert shards) beside the replica."""
        return self.parallel.pipeline > 1 or self.parallel.expert_parallel > 1

    def resolved(self) -> ServeArgs:
        """The checkpoint path and model name filled in (the default checkpoint is written on first use)."""
        path = os.path.abspath(os.path.expanduser(checkpoint_dir(self.model.model)))
        name = self.server.served_model_name or os.path.basename(path.rstrip("/"))
        tokenizer = self.model.tokenizer and os.path.abspath(os.path.expanduser(self.model.tokenizer))
        return self.model_copy(update={"model": self.model.model_copy(update={"model": path, "tokenizer": tokenizer}),
                                       "server": self.server.model_copy(update={"served_model_name": name})})

    def parallel_config(self) -> ParallelConfig:
        p = self.parallel
        return ParallelConfig(
            pipeline=p.pipeline, expert_parallel=p.expert_parallel,
            stage_resources=resources(p.stage_cpus, p.stage_gpus),
            shard_resources=resources(p.shard_cpus, p.shard_gpus),
            router_resources={"CPU": p.router_cpus}, placement_strategy=p.placement_strategy,
            stage_transport=p.stage_transport, handoff_transport=p.handoff_transport,
            moe_dispatch=p.moe_dispatch, redundant_experts=p.redundant_experts, rebalance_steps=p.rebalance_steps,
            vision_resources=resources(p.vision_cpus, p.vision_gpus),
        )


class LaunchSettings(Settings):
    """Where `k3ray serve` runs the app (not app args): Ray, and the HTTP address and proxies a
    Serve config YAML holds as http_options and proxy_location."""

    host: str | None = Field(
        None, description="bind address of HAProxy and the replicas' HTTP servers; 127.0.0.1 = this machine only, "
        "0.0.0.0 = the network (needed on nodes at several addresses: HAProxy reaches the replicas on other nodes "
        "at their node's address); null = 127.0.0.1, or with --address 0.0.0.0 unless the nodes share one "
        "loopback address")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    address: str | None = Field(None, description="join this Ray cluster; null = start a local Ray instance")
    ingress: Ingress | None = Field(
        None, description=f"HTTP in front of the replicas of a local Ray instance: HAProxy, each replica streaming "
        f"from its own HTTP server (haproxy), or Serve's proxy actor (proxy); null = {DEFAULT_INGRESS}; a joined "
        "cluster keeps its own (RAY_SERVE_ENABLE_HA_PROXY on its nodes)")
    proxy_location: ProxyLocation | None = Field(
        None, description="where the HTTP proxy (HAProxy) listens on the port: every node (EveryNode) or the head "
        "node only (HeadOnly); null = EveryNode, or HeadOnly on a cluster whose nodes share one address (one "
        "machine: they cannot all bind the port)")
    num_cpus: float | None = Field(None, gt=0, description="CPUs of the local Ray instance; null = all")
    stop_grace_s: float = Field(8.0, gt=0, description="how long Serve's graceful stop may take on Ctrl-C / "
                                "SIGTERM (requests in flight finish; an idle server stops in a few seconds) before "
                                "k3ray serve stops its processes outright and exits 1")

    @model_validator(mode="after")
    def _check(self) -> LaunchSettings:
        if self.address is not None and self.ingress is not None:
            raise ValueError("ingress applies to the local Ray instance k3ray serve starts; a cluster joined at an "
                             "address keeps the ingress its nodes started with (RAY_SERVE_ENABLE_HA_PROXY)")
        return self

    def on_nodes(self, addresses: list[str]) -> LaunchSettings:
        """These settings with host and proxy_location decided for Ray nodes at `addresses` (one per
        alive node; a local instance: its one node), as their descriptions say. ValueError for a
        choice that cannot serve there: a host other than every interface on nodes at several
        addresses, a proxy on every node where nodes share an address."""
        distinct = set(addresses)
        on_loopback = len(distinct) == 1 and ipaddress.ip_address(addresses[0]).is_loopback
        host = self.host or (LOOPBACK if on_loopback or self.address is None else ALL_INTERFACES)
        if len(distinct) > 1 and host not in (ALL_INTERFACES, "::"):
            raise ValueError(f"--host {host} on a cluster of nodes at {len(distinct)} addresses: HAProxy reaches the "
                             "replicas on other nodes at their node's address, which that bind refuses; use --host "
                             f"{ALL_INTERFACES} (and --api-key)")
        shared = len(addresses) > len(distinct)
        if shared and self.proxy_location == "EveryNode":
            raise ValueError(f"--proxy-location EveryNode: {len(addresses)} nodes share {len(distinct)} "
                             "address(es), and each node's HAProxy would bind the same port; use HeadOnly")
        proxies = self.proxy_location or ("HeadOnly" if shared else "EveryNode")
        return self.model_copy(update={"host": host, "proxy_location": proxies})


def resources(cpus: float, gpus: float) -> dict[str, float]:
    """A Ray resource dict (no GPU key without GPUs)."""
    return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}
