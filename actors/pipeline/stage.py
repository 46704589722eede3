"""PipelineStage actor: contiguous layers [a, b) of the model with their caches, on the GPU Ray
gave it (else the CPU); its MoE layers are built with remote experts, which reach the router's
expert shards in the ParallelConfig.moe_dispatch mode (k3ray.actors.pipeline.moe_dispatch). The first
stage embeds, the last returns logits; between stages the AttnRes state (partial sum + bank)
travels as an object ref: a wire bundle through host memory, or the tensors themselves over Ray's
NCCL or GLOO transport when the runner asks (RayExecutor.hop_transport). Media embeddings (from the
replica's VisionEncoder, via the engine) are spliced in by the first stage."""

from __future__ import annotations

import time

import ray
import torch

from k3ray.actors.pipeline.actor_device import assigned_device, placement_info
from k3ray.actors.pipeline.expert_placement import Placement
from k3ray.actors.pipeline.moe_dispatch import DirectDispatch, MoEDispatch, RemoteExperts, make_dispatch
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.actors.pipeline.protocol import CacheSpec, StageFailure, WirePlan
from k3ray.actors.pipeline.restartable import Restartable
from k3ray.actors.pipeline.stage_records import NIXL, OBJECT_STORE, fetch_part, leave_part, own_part_on_host
from k3ray.actors.pipeline.wire import Bundle, pack, unpack, unpack_tagged
from k3ray.config import ModelConfig
from k3ray.engine.disagg.handoff import CacheRecord, read_record, write_record
from k3ray.models.forward_batch import ModelCache
from k3ray.models.init import build_model
from k3ray.vision.placeholders import splice_media_embeddings
from k3ray.weights import load_checkpoint


class PipelineStage(Restartable):
    def __init__(self, checkpoint: str, layer_range: tuple[int, int], cache_spec: CacheSpec,
                 router: "ray.actor.ActorHandle | None", parallel: ParallelConfig):
        torch.set_num_threads(parallel.torch_threads)
        config = ModelConfig.from_json_file(f"{checkpoint}/config.json")
        dtype = getattr(torch, cache_spec.dtype)
        self.dispatch: MoEDispatch | None = None
        if any(config.is_moe_layer(i) for i in range(*layer_range)):
            assert router is not None, "a stage with MoE layers needs a router"
            self.dispatch = make_dispatch(parallel.moe_dispatch, router, config.num_experts, parallel.call_timeout_s)
        self.device = assigned_device()
        model = build_model(config, dtype, seed=None, device=self.device, layer_range=layer_range,
                            experts=lambda layer_idx: RemoteExperts(self.dispatch, layer_idx))
        load_checkpoint(model, checkpoint)  # straight onto the model's device
        self.model = model.eval()
        self.layer_range, self.timeout_s = layer_range, parallel.call_timeout_s
        self.cache = ModelCache.allocate(config, cache_spec.num_state_slots, cache_spec.num_blocks,
                                         cache_spec.block_size, dtype=dtype, device=self.device,
                                         layers=range(*layer_range))

    @torch.inference_mode()  # as the local executor runs
    def forward(self, wire_plan: WirePlan, carry: Bundle | tuple[torch.Tensor, torch.Tensor] | None,
                on_device: bool = False) -> Bundle | tuple[torch.Tensor, torch.Tensor]:
        """First stage: carry is None. Returns (hidden [T, D], bank [T, R, D]) or, on the last
        stage, (logits [len(logits_indices), V] fp32,) — one wire bundle (k3ray.actors.pipeline.wire), or
        with `on_device` the (hidden, bank) tensors themselves on this stage's device, for Ray's NCCL
        or GLOO transport to carry (a carry that came that way arrives as those tensors, here)."""
        if self.restarted:  # the engine's sequences and prefix cache point into caches this process never held
            raise StageFailure(f"the stage of layers {self.layer_range} was restarted with empty caches")
        plan = wire_plan.decode()
        batch = plan.forward_batch(self.cache)  # indices to the cache's device, once for every layer
        if self.model.is_first:
            hidden, bank = self.model.embed(plan.input_ids.to(self.device)), []
            if plan.mm_positions is not None:
                hidden = splice_media_embeddings(hidden, plan.mm_positions.to(self.device),
                                                 plan.mm_embeds.to(self.device))
        else:
            hidden, stacked = carry if isinstance(carry, tuple) and isinstance(carry[0], torch.Tensor) \
                else (t.to(self.device) for t in unpack(carry))
            bank = list(stacked.unbind(1))
        hidden, bank = self.model.forward_layers(hidden, bank, batch)
        if self.dispatch is not None:
            self.dispatch.flush()
        if not self.model.is_last:
            stacked = torch.stack(bank, 1)
            return (hidden, stacked) if on_device else pack(hidden, stacked)
        idx = plan.logits_indices.to(self.device)
        return pack(self.model.head(hidden[idx], [b[idx] for b in bank]).float())

    @torch.inference_mode()
    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """KDA / conv state slot copies (prefix-cache snapshots, speculative rollback)."""
        self.cache.copy_states(src, dst)

    @torch.inference_mode()
    def read_handoff(self, slot: int, rows: torch.Tensor, left_with: str = OBJECT_STORE
                     ) -> tuple[dict[str, int], CacheRecord | list[ray.ObjectRef]]:
        """(its size, this stage's layers' part of one sequence's caches): prefill/decode disaggregation.
        For the object store: on the host, called with num_returns=2 so the part can stay there while
        the size is read; for NIXL: on this stage's device, left here (stage_records.leave_part)."""
        if left_with == NIXL:
            record = read_record(self.cache, slot, rows, self.device)
            return record.nbytes(), leave_part(record)
        record = read_record(self.cache, slot, rows)
        return record.nbytes(), record

    @torch.inference_mode()
    def write_handoff(self, record: CacheRecord | list[ray.ObjectRef], slot: int, rows: torch.Tensor) -> None:
        """Write a part: a record, or one left at a prefill stage with NIXL (fetched onto this device)."""
        if isinstance(record, list):
            record = fetch_part(record[0], self.device, self.timeout_s)
        write_record(self.cache, record, slot, rows)

    def handoff_part_on_host(self, part: list[ray.ObjectRef]) -> CacheRecord:
        """A part this stage left with NIXL, on the host, for a receiver that is no stage (StageRecords.materialize)."""
        return own_part_on_host(part[0], self.timeout_s)

    def flush_load(self) -> None:
        """Direct dispatch: hand the counts of the steps so far to the router, and wait for it."""
        if self.dispatch is not None:
            ref = self.dispatch.flush()
            if ref is not None:
                ray.get(ref, timeout=self.timeout_s)

    @torch.inference_mode()
    def dispatch_times_ms(self, rows: Bundle, repeats: int) -> list[float]:
        """Wall times of this stage's direct or compiled dispatch of one layer's rows (tagged with
        the layer), ms (k3ray bench cluster; a compiled graph can only be driven by the process that
        compiled it)."""
        assert isinstance(self.dispatch, DirectDispatch), "only a stage with direct or compiled dispatch"
        layer_idx, (h, ids, weights) = unpack_tagged(rows)
        self.dispatch.fan_out(layer_idx, h, ids, weights)  # compiles the graph, warms both paths
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.dispatch.fan_out(layer_idx, h, ids, weights)
            times.append(1000 * (time.perf_counter() - t0))
        return times

    def reset_dispatch(self, placement: Placement | None) -> None:
        """After a fault in the replica: the MoE dispatch takes up the router's reset placement
        (MoERouter.reset_placement) and drops what the fault left (a failed report, a compiled graph)."""
        if self.dispatch is not None:
            self.dispatch.reset(placement)

    def relay(self, carry):
        """Hand a carry straight on (measures the Ray cost of one pipeline hop)."""
        return carry

    def ready(self) -> dict:
        return {"layers": self.layer_range, **placement_info(self.device), "restarted": self.restarted}
