"""Handoffs between Ray pipelines (prefill/decode disaggregation): a prefill pipeline leaves each
stage's part of the caches in the object store; a decode pipeline with the same layer split writes
each part at the stage holding those layers, any other receiver (another split, a local engine)
fetches the record first. Greedy outputs equal the local engine's either way, and a part whose
owner is gone is a HandoffMismatchError (the sender asks again), not a fault of the decode pipeline.
A prefill pipeline with handoff_transport="nixl" leaves the parts in its stages' own memory for Ray's
NIXL tensor transport instead (GPU memory on GPU stages; CPU memory here, the same code path), and
they are freed once the decode side has written them."""

import gc
import time
from dataclasses import replace

import pytest
import ray

from k3ray.actors.pipeline.executor import RayExecutor
from k3ray.actors.pipeline.config import ParallelConfig
from k3ray.actors.pipeline.stage_records import StageRecords
from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.disagg.handoff import HandoffMismatchError
from k3ray.sampling_params import RequestOutputKind
from k3ray.testing import finish_request
from k3ray.weights import load_model

pytestmark = pytest.mark.timeout(900)
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_blocks=64, snapshot_interval=1)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(stage_resources={"CPU": 0.25}, shard_resources={"CPU": 0.25}, router_resources={"CPU": 0.25})
PROMPTS = [[(7 * i + 3) % 250 for i in range(n)] for n in (13, 40)]


@ray.remote(num_cpus=0.1)
class Owner:
    def hold(self, part, tensor_transport=None):
        return [ray.put(part, _tensor_transport=tensor_transport)]  # in a list: the caller gets the reference

    def handoff_part_on_host(self, part):  # as a prefill stage answers (PipelineStage)
        return ray.get(part[0])


def prefill(engine, request_id, prompt, held):
    engine.add_request(request_id, prompt, replace(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY), export_from=held)
    return finish_request(engine, request_id).handoff


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny_checkpoint):
    built = {"local": LLMEngine(LocalExecutor(load_model(tiny_checkpoint)), CONFIG)}
    executors = []
    layouts = {"pp2": (2, 1, "object-store"), "pp2-decode": (2, 1, "auto"), "ep2": (1, 2, "auto"),
               "pp2-nixl": (2, 1, "nixl")}
    for name, (pipeline, experts, transport) in layouts.items():
        parallel = ParallelConfig(pipeline, experts, handoff_transport=transport, **SMALL)
        executors.append(RayExecutor(tiny_checkpoint, parallel, name=f"handoff-{name}"))
        built[name] = LLMEngine(executors[-1], CONFIG)
    yield built
    for executor in executors:
        executor.shutdown()


def reference(engines, prompt):
    engines["local"].add_request("ref", prompt, GREEDY)
    return finish_request(engines["local"], "ref").outputs[0].token_ids


@pytest.mark.parametrize("sender, transport", [("pp2", "stage-direct"), ("pp2-nixl", "stage-direct-nixl")])
@pytest.mark.parametrize("decode", ["pp2-decode", "ep2", "local"])
def test_a_pipelines_handoff_continues_on_any_layout(engines, sender, transport, decode):
    for i, prompt in enumerate(PROMPTS):
        rid = f"{sender}-{decode}-{i}"
        handoff = prefill(engines[sender], rid, prompt, engines[decode].held_prefix_tokens(prompt))
        assert isinstance(handoff.records[0], StageRecords) and handoff.transport == transport
        engines[decode].add_request(rid, prompt, GREEDY, handoff=handoff)
        assert finish_request(engines[decode], rid).outputs[0].token_ids == reference(engines, prompt)


def held_nixl_objects(stages) -> list[int]:
    """Objects Ray's tensor transport holds in each stage actor's memory."""
    return ray.get([stage.__ray_call__.remote(
        lambda self: ray._private.worker.global_worker.rdt_manager.rdt_store.get_num_objects()) for stage in stages])


def wait_held(stages, expected: list[int], timeout_s: float = 60) -> None:
    """Until the stages hold `expected` parts (a reference dropped frees its part asynchronously)."""
    gc.collect()
    deadline = time.monotonic() + timeout_s
    while (held := held_nixl_objects(stages)) != expected:
        assert time.monotonic() < deadline, f"the prefill stages hold {held} parts, expected {expected}"
        time.sleep(0.5)


def test_nixl_parts_stay_at_the_prefill_stages_until_written(engines):
    sender, decode = engines["pp2-nixl"], engines["pp2-decode"]
    stages = [g.stage for g in sender.executor.groups]
    wait_held(stages, [0, 0])  # the earlier tests' handoffs are gone, and so are their parts
    prompt = PROMPTS[1]
    handoff = prefill(sender, "nixl-held", prompt, 0)
    assert held_nixl_objects(stages) == [1, 1]  # one part each, on the stage
    assert handoff.nbytes() == handoff.records[0].materialize().nbytes()  # sizes as read, without fetching
    decode.add_request("nixl-held", prompt, GREEDY, handoff=handoff)
    assert finish_request(decode, "nixl-held").outputs[0].token_ids == reference(engines, prompt)
    del handoff
    wait_held(stages, [0, 0])  # freed once no reference is left: nothing leaks on the prefill side


@pytest.mark.parametrize("sender, transport", [("pp2", None), ("pp2-nixl", "nixl")])
def test_parts_lost_with_their_owner_are_asked_for_again(engines, sender, transport):
    prompt = PROMPTS[1]
    handoff = prefill(engines[sender], f"lost-{sender}", prompt, 0)
    owner = Owner.remote()  # the parts as objects of an owner that then dies, as a lost prefill stage's do
    record = handoff.records[0]
    whole = record.materialize()
    record.parts = [(layers, ray.get(owner.hold.remote(whole.select(range(*layers)), transport))[0])
                    for layers, _ in record.parts]
    ray.kill(owner)
    decode = engines["pp2-decode"]
    decode.add_request(f"lost-{sender}", prompt, GREEDY, handoff=handoff)
    with pytest.raises(HandoffMismatchError, match="lost in transit"):
        finish_request(decode, f"lost-{sender}")
    assert decode.executor.health()["healthy"]
    decode.add_request(f"again-{sender}", prompt, GREEDY, handoff=prefill(engines[sender], "again", prompt, 0))
    assert finish_request(decode, f"again-{sender}").outputs[0].token_ids == reference(engines, prompt)


def test_a_stage_lost_before_another_layout_asks_for_its_part_is_asked_for_again(engines):
    """A receiver laid out otherwise asks each prefill stage for its NIXL part on the host: a stage gone
    by then is lost in transit, as a lost part is."""
    prompt = PROMPTS[1]
    handoff = prefill(engines["pp2-nixl"], "stage-lost", prompt, 0)
    gone = Owner.remote()  # a prefill stage's stand-in, dead before it is asked
    ray.get(gone.__ray_ready__.remote())
    ray.kill(gone)
    handoff.records[0].stages = [gone] * len(handoff.records[0].parts)
    decode = engines["ep2"]
    decode.add_request("stage-lost", prompt, GREEDY, handoff=handoff)
    with pytest.raises(HandoffMismatchError, match="lost in transit"):
        finish_request(decode, "stage-lost")
    assert decode.executor.health()["healthy"]


@pytest.mark.parametrize("decode", ["ep2", "local"])
def test_a_receiver_that_is_no_stage_keeps_no_core_busy(engines, decode):
    """NIXL parts taken here (a local engine, a single-stage executor in this process): each prefill stage
    hands its part over on the host, so this process starts no NIXL agent, whose progress thread would
    keep a core busy from then on."""
    prompt = PROMPTS[0]
    handoff = prefill(engines["pp2-nixl"], f"idle-{decode}", prompt, 0)
    engines[decode].add_request(f"idle-{decode}", prompt, GREEDY, handoff=handoff)
    assert finish_request(engines[decode], f"idle-{decode}").outputs[0].token_ids == reference(engines, prompt)
    cpu = time.process_time()
    time.sleep(2)
    assert time.process_time() - cpu < 0.5, "this process kept a core busy after taking a NIXL handoff"
