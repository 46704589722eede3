"""The app's arguments (`k3ray serve` flags, the `args:` of a Serve config YAML) and the Serve
deployment options they imply: autoscaling, the bounded queue (429), and for a pipeline or expert
split the replica's placement-group bundles (its own bundle first, then one per model actor)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from k3ray.actors.openai_middleware import DEFAULT_MAX_BODY_BYTES


class ServeArgs(BaseModel):
    """Every option of one deployed model; unknown keys are an error (a typo never goes unnoticed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # model
    model: str | None = Field(None, description="checkpoint directory; None = the default tiny K3")
    served_model_name: str | None = Field(None, description="the model id clients send; default: the folder name")
    dtype: Literal["float32", "bfloat16"] = "float32"
    # one replica = one model pipeline
    pipeline: int = Field(1, ge=1)
    expert_parallel: int = Field(1, ge=1)
    replica_cpus: float = Field(1.0, gt=0)
    stage_cpus: float = Field(1.0, gt=0)
    shard_cpus: float = Field(1.0, gt=0)
    router_cpus: float = Field(0.5, gt=0)
    stage_gpus: float = Field(0, ge=0, description="GPUs per pipeline-stage actor (0 on CPU clusters)")
    shard_gpus: float = Field(0, ge=0, description="GPUs per expert-shard actor")
    replica_gpus: float = Field(0, ge=0, description="GPUs of the replica itself (a local, undistributed model)")
    vision_cpus: float = Field(0.5, gt=0, description="CPUs of a pipeline replica's VisionEncoder actor")
    vision_gpus: float = Field(0, ge=0)
    # media in chat requests
    allow_remote_media_urls: bool = Field(False, description="fetch http(s) image/video URLs (off: data: URLs only)")
    max_media_bytes: int | None = Field(None, ge=1, description="per media item; default 64 MiB")
    max_media_per_prompt: int = Field(128, ge=0)
    media_fetch_timeout_s: float = Field(10.0, gt=0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    moe_dispatch: Literal["router", "direct", "compiled"] = Field(
        "direct", description="MoE rows from each stage straight to its shards by actor calls, through the stage's "
        "router actor, or through a Ray Compiled Graph")
    torch_threads: int | None = Field(None, ge=1)
    engine_process: bool = Field(
        True, description="run an undistributed model's engine in its own process (no GIL shared with HTTP work)")
    # autoscaling (Serve's AutoscalingConfig)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    metrics_interval_s: float = Field(10.0, gt=0)
    look_back_period_s: float = Field(30.0, gt=0)
    # admission
    max_ongoing_requests: int | None = Field(None, ge=1, description="per replica; default max_num_seqs")
    max_queued_requests: int = Field(256, ge=-1, description="requests waiting for a replica, then 429; -1: no bound")
    retry_after_s: float = Field(1.0, ge=0)
    api_key: str | None = Field(None, description="require `Authorization: Bearer <key>`; default $K3RAY_API_KEY")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1)
    # engine (EngineConfig)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    block_size: int = Field(16, ge=1)
    cache_memory_mb: float | None = Field(None, gt=0)
    enable_prefix_caching: bool = True
    speculative_ngram: int = Field(0, ge=0, description="draft tokens per step by n-gram lookup; 0 = off")
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> ServeArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas={self.initial_replicas} is outside [min_replicas, max_replicas]")
        return self

    @property
    def distributed(self) -> bool:
        """Whether the model runs as Ray actors (pipeline stages / expert shards) beside the replica."""
        return self.pipeline > 1 or self.expert_parallel > 1

    def resolved(self) -> ServeArgs:
        """The checkpoint path and model name filled in (the default checkpoint is written on first use)."""
        model = self.model
        if model is None:
            from k3ray.default_model import default_checkpoint_dir

            model = default_checkpoint_dir()
        model = os.path.abspath(os.path.expanduser(model))
        name = self.served_model_name or os.path.basename(model.rstrip("/"))
        return self.model_copy(update={"model": model, "served_model_name": name})

    def parallel_config(self):
        from k3ray.actors.protocol import ParallelConfig

        return ParallelConfig(
            pipeline=self.pipeline, expert_parallel=self.expert_parallel,
            stage_resources=_resources(self.stage_cpus, self.stage_gpus),
            shard_resources=_resources(self.shard_cpus, self.shard_gpus),
            router_resources={"CPU": self.router_cpus}, placement_strategy=self.placement_strategy,
            moe_dispatch=self.moe_dispatch,
            vision_resources=_resources(self.vision_cpus, self.vision_gpus),
        )


def deployment_options(args: ServeArgs) -> dict:
    """Options for `K3Server.options(...)`; args must be resolved (a checkpoint path is needed to
    size a distributed replica's placement group)."""
    from ray.serve.config import BackpressureConfig

    autoscaling = {
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "target_ongoing_requests": args.target_ongoing_requests,
        "upscale_delay_s": args.upscale_delay_s,
        "downscale_delay_s": args.downscale_delay_s,
        "metrics_interval_s": args.metrics_interval_s,
        "look_back_period_s": args.look_back_period_s,
    }
    if args.initial_replicas is not None:
        autoscaling["initial_replicas"] = args.initial_replicas
    options = {
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": args.max_ongoing_requests or args.max_num_seqs,
        "max_queued_requests": args.max_queued_requests,
        "ray_actor_options": {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus},
    }
    if args.max_queued_requests >= 0:
        options["backpressure_config"] = BackpressureConfig(status_code=429, retry_after_s=args.retry_after_s)
    if args.distributed:
        from k3ray.actors.pipeline_replica import actor_bundles
        from k3ray.config import ModelConfig

        assert args.model is not None, "resolve() the args first"
        config = ModelConfig.from_json_file(os.path.join(args.model, "config.json"))
        bundles, _ = actor_bundles(config, args.parallel_config())
        options["placement_group_bundles"] = [_resources(args.replica_cpus, args.replica_gpus)] + bundles
        options["placement_group_strategy"] = args.placement_strategy
    return options


def _resources(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}
