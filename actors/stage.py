"""PipelineStage actor: contiguous layers [a, b) of the model with their caches; its MoE layers
send the latent rows to the stage's Router actor, or straight to the router's expert shards by
actor calls or through a Ray Compiled Graph (ParallelConfig.moe_dispatch, see k3ray.actors.router).
The first stage embeds, the last returns logits; between stages the AttnRes state (partial sum +
bank) travels as an object ref. Media embeddings (from the replica's VisionEncoder, via the engine)
are spliced in by the first stage."""

from __future__ import annotations

import ray
import torch
from torch import nn

from k3ray.actors.protocol import CacheSpec, StageFailure, StepArgs
from k3ray.actors.router import combine, fan_out, split
from k3ray.actors.wire import Bundle, pack, unpack, unpack_raw, unpack_tagged


class DirectDispatch:
    """A stage's MoE layers calling the router's shards themselves; the load counts go to the
    router once per step (`flush`, not awaited)."""

    def __init__(self, router: "ray.actor.ActorHandle", num_experts: int, timeout_s: float):
        self.router, self.timeout_s = router, timeout_s
        self.shards = ray.get(router.shard_map.remote(), timeout=timeout_s)
        self.load = torch.zeros(num_experts, dtype=torch.long)
        self.dispatches = 0

    def __call__(self, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = self.fan_out(layer_idx, h, ids, weights)
        self.load += torch.bincount(ids.flatten(), minlength=self.load.numel())
        self.dispatches += 1
        return y

    def fan_out(self, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fan_out(self.shards, layer_idx, h, ids, weights, self.timeout_s)

    def flush(self) -> "ray.ObjectRef | None":
        if not self.dispatches:
            return None
        ref = self.router.record_load.remote(pack(self.load), self.dispatches)
        self.load = torch.zeros_like(self.load)
        self.dispatches = 0
        return ref


class CompiledDispatch(DirectDispatch):
    """Direct dispatch through a Ray Compiled Graph that the stage compiles over its shards: the
    rows go out and the partial outputs come back over Ray's compiled-graph channels instead of one
    actor call per shard. Every shard gets a (possibly empty) slice each layer, since a compiled
    graph runs all its nodes. A failed execution tears the graph down; the next call compiles it
    again (a restarted shard is a new process). A restarted stage restarts its shards first."""

    def __init__(self, router: "ray.actor.ActorHandle", num_experts: int, timeout_s: float):
        super().__init__(router, num_experts, timeout_s)
        self.graph = None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._restart_shards()

    def _restart_shards(self) -> None:
        """A restarted stage: its shards may still be held by the dead stage's compiled graph (an
        actor runs one at a time, and a graph whose driver died is not released), so they restart
        too, reloading their weights."""
        import time

        for _, _, shard in self.shards:
            ray.kill(shard, no_restart=False)
        deadline = time.monotonic() + self.timeout_s
        for _, _, shard in self.shards:
            while True:
                try:
                    ray.get(shard.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ray.exceptions.RayActorError:  # still going down or coming back
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def fan_out(self, layer_idx: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.graph = self._compile()
        _, bundles, rows = split(self.shards, layer_idx, h, ids, weights, every_shard=True)
        try:
            parts = ray.get(self.graph.execute(*bundles), timeout=self.timeout_s)
        except Exception as e:
            self.close()
            raise StageFailure(f"compiled MoE dispatch of layer {layer_idx} failed: {type(e).__name__}: {e}") from e
        return combine(h.shape, rows, parts)

    def _compile(self):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:  # inp[s]: shard s's rows, tagged with the layer
            graph = MultiOutputNode([shard.compute.bind(inp[s]) for s, (_, _, shard) in enumerate(self.shards)])
        return graph.experimental_compile()

    def close(self) -> None:
        if self.graph is not None:
            graph, self.graph = self.graph, None
            try:
                graph.teardown()
            except Exception:  # noqa: BLE001 - a graph with a dead actor may not tear down cleanly
                pass


class RemoteExperts(nn.Module):
    """Stands where LocalExperts would: the same call, answered by the Router actor or, with a
    DirectDispatch, by the shards."""

    def __init__(self, router: "ray.actor.ActorHandle", layer_idx: int, timeout_s: float,
                 direct: DirectDispatch | None = None):
        super().__init__()
        self.router, self.layer_idx, self.timeout_s, self.direct = router, layer_idx, timeout_s, direct

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.direct is not None:
            return self.direct(self.layer_idx, h, ids, weights)
        ref = self.router.dispatch.remote(pack(h, ids, weights, tag=self.layer_idx))
        return unpack_raw(ray.get(ref, timeout=self.timeout_s), torch.float32, h.shape)


class PipelineStage:
    def __init__(self, checkpoint: str, layer_range: tuple[int, int], cache_spec: CacheSpec,
                 router: "ray.actor.ActorHandle | None", call_timeout_s: float, torch_threads: int = 1,
                 moe_dispatch: str = "router"):
        from k3ray.config import ModelConfig
        from k3ray.models.forward_batch import ModelCache
        from k3ray.models.init import build_model
        from k3ray.weights import load_checkpoint

        torch.set_num_threads(torch_threads)
        config = ModelConfig.from_json_file(f"{checkpoint}/config.json")
        dtype = getattr(torch, cache_spec.dtype)
        has_moe = any(config.is_moe_layer(i) for i in range(*layer_range))
        # one placeholder expert per MoE layer, replaced below: the stage holds no routed experts
        model = build_model(config, dtype, seed=None, layer_range=layer_range, expert_range=(0, 1))
        self.direct: DirectDispatch | None = None
        if has_moe:
            assert router is not None, "a stage with MoE layers needs a router"
            if moe_dispatch in ("direct", "compiled"):
                kind = CompiledDispatch if moe_dispatch == "compiled" else DirectDispatch
                self.direct = kind(router, config.num_experts, call_timeout_s)
            for i, layer in model.model.layers.items():
                if hasattr(layer, "block_sparse_moe"):
                    layer.block_sparse_moe.experts = RemoteExperts(router, int(i), call_timeout_s, self.direct)
        load_checkpoint(model, checkpoint)
        self.model = model.eval()
        self.layer_range = layer_range
        self.cache = ModelCache.allocate(config, cache_spec.num_state_slots, cache_spec.num_blocks,
                                         cache_spec.block_size, dtype=dtype, layers=range(*layer_range))

    @torch.inference_mode()  # as the local executor runs
    def forward(self, step: StepArgs, carry: Bundle | None) -> Bundle:
        """First stage: carry is None. Returns (hidden [T, D], bank [T, R, D]) or, on the last
        stage, (logits [len(logits_indices), V] fp32,) — one wire bundle (k3ray.actors.wire)."""
        from k3ray.models.forward_batch import ForwardBatch
        from k3ray.vision.placeholders import splice_media_embeddings

        batch = ForwardBatch(**step.batch_kwargs(), cache=self.cache)
        if self.model.is_first:
            hidden, bank = self.model.embed(step.input_ids), []
            if step.mm_positions is not None:
                hidden = splice_media_embeddings(hidden, step.mm_positions, step.mm_embeds)
        else:
            hidden, stacked = unpack(carry)
            bank = list(stacked.unbind(1))
        hidden, bank = self.model.forward_layers(hidden, bank, batch)
        if self.direct is not None:
            self.direct.flush()
        if not self.model.is_last:
            return pack(hidden, torch.stack(bank, 1))
        idx = step.logits_indices
        if idx is not None:
            hidden, bank = hidden[idx], [b[idx] for b in bank]
        return pack(self.model.head(hidden, bank).float())

    @torch.inference_mode()
    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """KDA / conv state slot copies (prefix-cache snapshots, speculative rollback)."""
        s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        for pool in (*self.cache.kda_state.values(), *self.cache.conv_state.values()):
            pool[d] = pool[s]

    def flush_load(self) -> None:
        """Direct dispatch: hand the counts of the steps so far to the router, and wait for it."""
        if self.direct is not None:
            ref = self.direct.flush()
            if ref is not None:
                ray.get(ref, timeout=self.direct.timeout_s)

    @torch.inference_mode()
    def dispatch_times_ms(self, rows: Bundle, repeats: int) -> list[float]:
        """Wall times of this stage's direct or compiled dispatch of one layer's rows (tagged with
        the layer), ms (k3ray bench cluster; a compiled graph can only be driven by the process that
        compiled it)."""
        import time

        assert self.direct is not None, "only a stage with direct or compiled dispatch"
        layer_idx, (h, ids, weights) = unpack_tagged(rows)
        self.direct.fan_out(layer_idx, h, ids, weights)  # compiles the graph, warms both paths
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.direct.fan_out(layer_idx, h, ids, weights)
            times.append(1000 * (time.perf_counter() - t0))
        return times

    def relay(self, carry):
        """Hand a carry straight on (measures the Ray cost of one pipeline hop)."""
        return carry

    def ready(self) -> dict:
        return {"layers": self.layer_range, "node_id": ray.get_runtime_context().get_node_id()}
