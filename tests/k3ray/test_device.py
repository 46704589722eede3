"""Every entry point honours an explicit `device` (the CPU here: CI has no GPU; tests/gpu/ runs the
model, engine and graphs on CUDA), `resolve_device` refuses what it cannot give before anything
loads, and the CUDA graphs' padded decode batch, run eagerly, changes nothing but the real rows."""

import pytest
import torch

from k3ray.api import K3
from k3ray.cli import main as k3ray_main
from k3ray.config import preset
from k3ray.device import resolve_device, to_device
from k3ray.engine import LLM, SamplingParams
from k3ray.engine.config import EngineConfig
from k3ray.engine.execution.cuda_graphs import DecodeInputs, decode_batch_sizes
from k3ray.engine.execution.plan import BatchPlan
from k3ray.engine.sample.sampler import logprob_entries, sample_tokens
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.init import build_model
from k3ray.vision import encode_media, load_vision
from k3ray.weights import load_model

CPU = torch.device("cpu")
MICRO = preset("k3-micro")
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")


def batch_tensors(batch: ForwardBatch) -> dict[str, torch.Tensor]:
    """Every tensor a model step reads: the batch's indices and its cache's pools."""
    named = {k: v for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    for kind in ("kda_state", "conv_state", "mla_latent"):
        named.update({f"{kind}[{layer}]": t for layer, t in getattr(batch.cache, kind).items()})
    return named


def record_batches(model) -> list[ForwardBatch]:
    """The ForwardBatch of every forward the (real) model runs from now on."""
    seen: list[ForwardBatch] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    return seen


def assert_on(device: torch.device, named: dict[str, torch.Tensor]) -> None:
    wrong = {name: t.device for name, t in named.items() if t.device != device}
    assert not wrong, f"not on {device}: {wrong}"


def test_resolve_device_names():
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == resolve_device("cpu:0") == CPU
    auto = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
    assert resolve_device("auto") == resolve_device(None) == auto


@pytest.mark.parametrize("bad", [pytest.param("gpu", id="gpu-name"), "meta", "mps", "cuda:x", "", "tpu:0"])
def test_other_devices_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, cuda:N"):
        resolve_device(bad)


@without_cuda
@pytest.mark.parametrize("asked", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_is_a_clear_error(asked):
    with pytest.raises(ValueError, match="sees no CUDA device on this machine"):
        resolve_device(asked)


@without_cuda
def test_every_loader_refuses_cuda_before_loading(tiny_checkpoint):
    loaders = [
        lambda: K3.load(tiny_checkpoint, device="cuda"),
        lambda: LLM(tiny_checkpoint, device="cuda"),
        lambda: LLM(build_model(MICRO), device="cuda:0"),
        lambda: load_model(tiny_checkpoint, device="cuda"),
        lambda: load_vision(tiny_checkpoint, device="cuda"),
    ]
    for load in loaders:
        with pytest.raises(ValueError, match="sees no CUDA device"):
            load()


@without_cuda
@pytest.mark.parametrize("argv", [
    ["generate", "--device", "cuda", "--max-tokens", "1"],
    ["bench", "model", "--device", "cuda:0", "--repeats", "1"],
])
def test_commands_report_a_missing_cuda_as_an_error(argv, tiny_checkpoint, capsys):
    if argv[0] == "generate":
        argv = argv + ["--model", tiny_checkpoint]
    assert k3ray_main(argv) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_generate_runs_on_an_explicit_cpu(tiny_checkpoint, capsys):
    assert k3ray_main(["generate", "--model", tiny_checkpoint, "--device", "cpu", "--max-tokens", "2"]) == 0
    assert "new tokens" in capsys.readouterr().out


def test_to_device_copies_indices_as_int64():
    a, b = torch.tensor([3, 1, 2], dtype=torch.int32), torch.arange(6).view(2, 3)
    moved = to_device([a, b], CPU)
    assert [t.dtype for t in moved] == [torch.long, torch.long] and moved[1].shape == (2, 3)
    assert moved[0].tolist() == [3, 1, 2] and torch.equal(moved[1], b)


def test_a_forward_batch_lives_on_its_cache_device():
    cache = ModelCache.allocate(MICRO, 4, 8, 4, device="cpu")
    batch = ForwardBatch(torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([3, 6]), torch.tensor([0, 2]),
                         torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), cache)
    assert cache.device == CPU
    assert_on(CPU, batch_tensors(batch))
    assert batch.slot_mapping.tolist() == [0, 1, 2, 13] and batch.num_tokens == 4 and not batch.is_decode


def test_k3_keeps_weights_caches_steps_and_logits_on_its_device(tiny_checkpoint):
    k3 = K3.load(tiny_checkpoint, device="cpu")
    assert k3.device == CPU
    assert_on(CPU, dict(k3.model.state_dict()))
    seen = record_batches(k3.model)
    ids = list(range(40, 60))
    assert k3.logits(ids).device == CPU
    k3.generate(ids, max_new_tokens=3, temperature=0.7, top_k=5, seed=1)
    assert len(seen) == 1 + 1 + 2  # logits, the generation's prefill, two decodes
    for batch in seen:
        assert_on(CPU, batch_tensors(batch))


def test_llm_keeps_weights_caches_steps_and_sampling_on_its_device(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", max_num_seqs=4, num_blocks=32, block_size=8)
    executor = llm.engine.executor
    assert executor.device == CPU and executor.graphs is None  # the CPU never captures graphs
    assert_on(CPU, dict(executor.model.state_dict()))
    seen = record_batches(executor.model)
    logits_seen: list[torch.Tensor] = []
    executor.model.register_forward_hook(lambda module, args, out: logits_seen.append(out))
    params = [SamplingParams(temperature=0, max_tokens=3, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=3, prompt_logprobs=1)]
    outs = llm.generate([list(range(10, 30)), list(range(50, 55))], params)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert len(outs[0].outputs[0].logprobs) == 3 and outs[1].prompt_logprobs
    assert seen and logits_seen
    for batch in seen:
        assert_on(CPU, batch_tensors(batch))
    assert_on(CPU, {f"logits {i}": t for i, t in enumerate(logits_seen)})


def test_sampling_results_stay_on_the_logits_device():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=5), SamplingParams(temperature=0.9)]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    tokens = sample_tokens(logits, params, gens)
    assert tokens.device == logits.device and tokens.dtype == torch.long and int(tokens[0]) == int(logits[0].argmax())
    entries = logprob_entries(logits, tokens, num_top=2)
    assert [len(e) >= 2 for e in entries] == [True] * 3
    assert entries[0][int(tokens[0])].rank == 1


def test_the_vision_tower_loads_and_encodes_on_its_device(tiny_checkpoint):
    vision = load_vision(tiny_checkpoint, device="cpu")
    assert_on(CPU, dict(vision.state_dict()))
    pixels = torch.rand(4, 3, vision.config.patch_size, vision.config.patch_size)
    out = encode_media(vision, pixels, torch.tensor([[1, 2, 2]]))
    assert out.device == CPU and out.shape[0] == 1


def test_enforce_eager_is_a_bool():
    assert EngineConfig(enforce_eager=True).enforce_eager
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig(enforce_eager="yes")


def test_decode_batch_buckets():
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(5) == [1, 2, 4, 5]
    assert decode_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_padding_a_decode_batch_as_the_graphs_do_changes_nothing_but_the_real_rows():
    """Real rows: their logits and cache writes equal the plain batch's; padding rows (state slot -1,
    row 0's latent to row 0's slot) write nothing anywhere else."""
    model = build_model(MICRO, seed=0)
    block, lens, slots = 4, [5, 9, 2], [1, 3, 5]
    cache = ModelCache.allocate(MICRO, 8, 16, block)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    prompts = torch.randint(0, MICRO.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 5, 14, 16])
    with torch.no_grad():
        model(prompts, ForwardBatch(cu, torch.tensor(lens), torch.tensor(slots), tables, cache))
    padded_cache = ModelCache({k: v.clone() for k, v in cache.kda_state.items()},
                              {k: v.clone() for k, v in cache.conv_state.items()},
                              {k: v.clone() for k, v in cache.mla_latent.items()}, block)
    plan = BatchPlan(torch.tensor([7, 8, 9]), torch.arange(4), torch.tensor(lens) + 1, torch.tensor(slots), tables,
                     torch.arange(3))
    inputs = DecodeInputs(max_batch=8, max_blocks=5, device=CPU)
    inputs.block_tables.fill_(15)  # stale columns past the plan's table are never read
    inputs.fill(plan, 8, block)
    with torch.no_grad():
        plain = model(plan.input_ids, plan.forward_batch(cache))
        padded = model(inputs.ids[:8], inputs.forward_batch(8, padded_cache))
    torch.testing.assert_close(padded[:3], plain)
    for kind in ("kda_state", "conv_state", "mla_latent"):
        for layer, pool in getattr(cache, kind).items():
            torch.testing.assert_close(getattr(padded_cache, kind)[layer], pool, msg=f"{kind}[{layer}]")
