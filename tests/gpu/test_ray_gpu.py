"""Ray on one GPU: pipeline 2 x expert-parallel 2, every stage and expert shard on a fraction of the
GPU, gives the local model's logits on that GPU. Skipped without CUDA, and without Ray (the
prepared GPU host has none: tests/gpu/run.sh)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
ray = pytest.importorskip("ray")

from k3ray.actors.pipeline.executor import RayExecutor  # noqa: E402
from k3ray.actors.pipeline.config import ParallelConfig  # noqa: E402
from k3ray.actors.pipeline.protocol import CacheSpec  # noqa: E402
from k3ray.engine.execution.plan import BatchPlan  # noqa: E402
from k3ray.models.forward_batch import ModelCache  # noqa: E402
from k3ray.weights import load_model  # noqa: E402

BS = 8
SPEC = CacheSpec(num_state_slots=4, num_blocks=32, block_size=BS)
# 2 stages + 4 shards on one GPU, the routers (and no vision actor) on the CPU
ONE_GPU = dict(stage_resources={"CPU": 1, "GPU": 0.15}, shard_resources={"CPU": 1, "GPU": 0.15},
               router_resources={"CPU": 0.5}, vision_resources=None)


@pytest.fixture(scope="module")
def ray_one_gpu():
    from k3ray.actors.cluster.ray_connect import connect

    if ray.is_initialized():
        pytest.skip("a Ray instance is already connected in this process (its nodes may have no GPU)")
    connect(address="local", num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def steps(ids: torch.Tensor, chunks: list[int]):
    pos = 0
    for n in chunks:
        yield BatchPlan(ids[pos : pos + n], torch.tensor([0, n]), torch.tensor([pos + n]), torch.tensor([0]),
                        torch.arange(8)[None], logits_indices=torch.arange(n))
        pos += n


def test_ray_pipeline_2x2_on_one_gpu_equals_local(ray_one_gpu, tiny_checkpoint):
    model = load_model(tiny_checkpoint, torch.float32, device="cuda")
    cache = ModelCache.allocate(model.config, SPEC.num_state_slots, SPEC.num_blocks, BS, device="cuda")
    plan = list(steps(torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(0)), [12, 1, 5, 1]))
    runner = RayExecutor(tiny_checkpoint, ParallelConfig(2, 2, **ONE_GPU), SPEC)
    try:
        infos = ray.get([h.ready.remote() for name, h in runner.actors() if not name.startswith("router")], timeout=60)
        assert all(info["device"].startswith("cuda") and info["gpu_ids"] for info in infos), infos
        assert runner.hop_transport == "host"  # stages on one GPU: NCCL cannot pair them
        for s in plan:
            with torch.no_grad():
                ref = model(s.input_ids.cuda(), s.forward_batch(cache)).float().cpu()
            out = runner.step(s)
            # fp32 on both sides, same CUDA kernels: only the summation order of the expert partials differs
            assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-4
            assert torch.equal(out.argmax(-1), ref.argmax(-1))
    finally:
        runner.shutdown()


def test_a_handoff_between_gpu_pipelines_goes_stage_to_stage_over_nixl(ray_one_gpu, tiny_checkpoint):
    """Disaggregation on GPU stages: `auto` picks Ray's NIXL transport, each prefill stage's part stays in
    its GPU memory and the decode stage holding those layers pulls it onto its own; greedy output equals
    the local engine's on the GPU."""
    pytest.importorskip("nixl")
    from dataclasses import replace

    from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams
    from k3ray.sampling_params import RequestOutputKind
    from k3ray.testing import finish_request

    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=BS, num_blocks=64, snapshot_interval=1)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [(7 * i + 3) % 250 for i in range(40)]
    local = LLMEngine(LocalExecutor(load_model(tiny_checkpoint, torch.float32, device="cuda")), config)
    local.add_request("ref", prompt, greedy)
    expected = finish_request(local, "ref").outputs[0].token_ids
    runners = [RayExecutor(tiny_checkpoint, ParallelConfig(2, 1, **ONE_GPU), name=f"nixl-{side}")
               for side in ("prefill", "decode")]
    try:
        sender, receiver = (LLMEngine(r, config) for r in runners)
        assert runners[0].handoff_transport == "nixl"
        sender.add_request("p", prompt, replace(greedy, output_kind=RequestOutputKind.FINAL_ONLY), export_from=0)
        handoff = finish_request(sender, "p").handoff
        assert handoff.transport == "stage-direct-nixl"
        receiver.add_request("d", prompt, greedy, handoff=handoff)
        assert finish_request(receiver, "d").outputs[0].token_ids == expected
    finally:
        for r in runners:
            r.shutdown()
