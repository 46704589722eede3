"""Handoffs between Ray pipelines (prefill/decode disaggregation): a prefill pipeline leaves each
stage's part of the caches in the object store; a decode pipeline with the same layer split writes
each part at the stage holding those layers, any other receiver (another split, a local engine)
fetches the record first. Greedy outputs equal the local engine's either way, and a part whose
owner is gone is a HandoffMismatchError (the sender asks again), not a fault of the decode pipeline."""

from dataclasses import replace

import pytest

from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.handoff import HandoffMismatchError
from k3ray.sampling_params import RequestOutputKind
from k3ray.testing import finish_request
from k3ray.weights import load_model

ray = pytest.importorskip("ray")

from k3ray.actors.pipeline.executor import RayExecutor  # noqa: E402
from k3ray.actors.pipeline.protocol import ParallelConfig  # noqa: E402
from k3ray.actors.pipeline.stage_records import StageRecords  # noqa: E402

pytestmark = pytest.mark.timeout(900)
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_blocks=64, snapshot_interval=1)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(stage_resources={"CPU": 0.25}, shard_resources={"CPU": 0.25}, router_resources={"CPU": 0.25})
PROMPTS = [[(7 * i + 3) % 250 for i in range(n)] for n in (13, 40)]


@ray.remote(num_cpus=0.1)
class Owner:
    def hold(self, part):
        return [ray.put(part)]  # in a list: the caller gets the reference, owned here




def prefill(engine, request_id, prompt, held):
    engine.add_request(request_id, prompt, replace(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY), export_from=held)
    return finish_request(engine, request_id).handoff


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_checkpoint):
    built = {"local": LLMEngine(LocalExecutor(load_model(tiny_checkpoint)), CONFIG)}
    executors = []
    for name, (pipeline, experts) in {"pp2": (2, 1), "pp2-decode": (2, 1), "ep2": (1, 2)}.items():
        parallel = ParallelConfig(pipeline, experts, **SMALL)
        executors.append(RayExecutor(tiny_checkpoint, parallel, name=f"handoff-{name}"))
        built[name] = LLMEngine(executors[-1], CONFIG)
    yield built
    for executor in executors:
        executor.shutdown()


def reference(engines, prompt):
    engines["local"].add_request("ref", prompt, GREEDY)
    return finish_request(engines["local"], "ref").outputs[0].token_ids


@pytest.mark.parametrize("decode", ["pp2-decode", "ep2", "local"])
def test_a_pipelines_handoff_continues_on_any_layout(engines, decode):
    for i, prompt in enumerate(PROMPTS):
        handoff = prefill(engines["pp2"], f"{decode}-{i}", prompt, engines[decode].held_prefix_tokens(prompt))
        assert isinstance(handoff.records[0], StageRecords) and handoff.transport == "stage-direct"
        engines[decode].add_request(f"{decode}-{i}", prompt, GREEDY, handoff=handoff)
        assert finish_request(engines[decode], f"{decode}-{i}").outputs[0].token_ids == reference(engines, prompt)


def test_parts_lost_with_their_owner_are_asked_for_again(engines):
    prompt = PROMPTS[1]
    handoff = prefill(engines["pp2"], "lost", prompt, 0)
    owner = Owner.remote()  # the parts as objects of an owner that then dies, as a lost prefill replica's do
    parts = handoff.records[0].parts
    handoff.records[0].parts = [(layers, ray.get(owner.hold.remote(ray.get(ref)))[0]) for layers, ref in parts]
    ray.kill(owner)
    decode = engines["pp2-decode"]
    decode.add_request("lost", prompt, GREEDY, handoff=handoff)
    with pytest.raises(HandoffMismatchError, match="lost in transit"):
        finish_request(decode, "lost")
    assert decode.executor.health()["healthy"]
    decode.add_request("again", prompt, GREEDY, handoff=prefill(engines["pp2"], "again", prompt, 0))
    assert finish_request(decode, "again").outputs[0].token_ids == reference(engines, prompt)
