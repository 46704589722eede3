"""Image prompts on the Ray executor (a 2-stage pipeline plus the replica's VisionEncoder actor)
== the same engine on the local executor with the tower in process: greedy tokens and
log-probabilities, with chunked prefill across the image spans and a prefix-cache hit."""

import base64
import io

import pytest
import ray
import torch
from PIL import Image

from k3ray.actors.cluster.ray_connect import connect  # ray.init off the repository root
from k3ray.actors.pipeline.executor import (
    RayExecutor,
    actor_bundles,
)
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.media.inputs import media_from_messages
from k3ray.engine.media.prompt_media import local_vision_encoder
from k3ray.tokenizer import load_tokenizer
from k3ray.vision import load_vision
from k3ray.weights import load_model

pytestmark = pytest.mark.timeout(600)
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=40, block_size=8, num_blocks=96, snapshot_interval=1)
PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def local_ray():
    """A private single-node Ray on loopback (or the session's cluster if one is up)."""
    started = not ray.is_initialized()
    if started:
        connect(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def png_url(seed: int, size=(84, 112)) -> str:
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed))
    buf = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def conversations() -> list[list[dict]]:
    def ask(seed, question):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(seed)}},
                                             {"type": "text", "text": question}]}]
    # the third repeats the first image and question: a prefix hit past the image
    return [ask(0, "What is it?"), ask(1, "And this?"), ask(0, "What is it?")]


def run(engine: LLMEngine) -> list:
    tok = engine.tokenizer
    outs = {}
    for wave in (conversations()[:2], conversations()[2:]):
        for convo in wave:
            rid = str(len(outs) + engine.stats.num_steps)
            engine.add_request(rid, tok.encode_chat(convo), PARAMS, media=media_from_messages(convo, engine.multimodal.media))
            outs[rid] = None
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return list(outs.values())


def test_ray_pipeline_with_vision_actor_equals_local(local_ray, tiny_checkpoint):
    tok = load_tokenizer(tiny_checkpoint)
    local = LLMEngine(LocalExecutor(load_model(tiny_checkpoint)), CONFIG, tok,
                      vision_encoder=local_vision_encoder(load_vision(tiny_checkpoint)))
    ref = run(local)
    parallel = ParallelConfig(pipeline=2, stage_resources={"CPU": 1}, shard_resources={"CPU": 0.5})
    executor = RayExecutor(tiny_checkpoint, parallel)
    assert executor.has_vision
    try:
        engine = LLMEngine(executor, CONFIG, tok, vision_encoder=executor.encode_media)
        assert "vision encoder" in executor.health()["actors"]
        got = run(engine)
        stats = engine.get_stats()
    finally:
        executor.shutdown()
    bundles, roles = actor_bundles(executor.config, parallel)
    assert roles[-1] == ("vision", 0, None) and bundles[-1] == {"CPU": 0.5}
    assert stats.prefix_cache_hits == local.get_stats().prefix_cache_hits > 0
    assert stats.media_items_encoded == local.get_stats().media_items_encoded == 2  # the hit skips the image
    for a, b in zip(got, ref):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos_got, pos_ref in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pos_got.keys() == pos_ref.keys()
            for t in pos_got:
                # fp32 on both sides: the stage split and expert dispatch only reorder sums
                assert abs(pos_got[t].logprob - pos_ref[t].logprob) <= 1e-4


def test_a_replica_without_a_vision_actor_refuses_to_encode(tiny_checkpoint):
    executor = RayExecutor(tiny_checkpoint, ParallelConfig(pipeline=2, vision_resources=None))
    assert not executor.has_vision
    bundles, roles = actor_bundles(executor.config, executor.parallel)
    assert all(role[0] != "vision" for role in roles)
