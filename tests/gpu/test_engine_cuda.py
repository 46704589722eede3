"""The engine on CUDA: greedy output equals the CPU's for 16 mixed-length prompts; a prefix-cache hit
equals a cold run, speculative greedy equals plain greedy and chunked prefill equals whole prefill,
all on the GPU; decode replayed from CUDA graphs equals eager decode. Skipped without CUDA."""

import pytest
import torch

from k3ray.config import preset
from k3ray.engine import LLM, SamplingParams, SpeculativeConfig
from k3ray.models.init import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
CUDA = torch.device("cuda", 0)
TINY = preset("k3-tiny")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


MIXED = prompts([3, 70, 17, 129, 1, 45, 8, 260, 33, 5, 96, 12, 2, 150, 64, 27])


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def gpu_model():
    return build_model(TINY, torch.float32, seed=0, device=CUDA)


def llm(model, **options):
    options = {"max_num_seqs": 16, "num_blocks": 512, "block_size": 16, **options}
    return LLM(model, **options)


def test_engine_greedy_on_cuda_equals_the_cpu(gpu_model):
    gpu = llm(gpu_model)
    assert gpu.engine.executor.device == CUDA
    cpu = llm(build_model(TINY, torch.float32, seed=0), device="cpu")
    assert token_ids(gpu.generate(MIXED, GREEDY)) == token_ids(cpu.generate(MIXED, GREEDY))


def test_cuda_graphs_equal_eager_decode(gpu_model):
    graphs, eager = llm(gpu_model), llm(gpu_model, enforce_eager=True)
    assert graphs.engine.executor.graphs is not None and eager.engine.executor.graphs is None
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    with_graphs, without = graphs.generate(MIXED, params), eager.generate(MIXED, params)
    assert token_ids(with_graphs) == token_ids(without)
    assert graphs.engine.executor.graphs.num_replays > 0
    for a, b in zip(with_graphs, without):  # the same logits, up to the padded batch's rounding
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in pb.items():
                assert pa[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)
    # one decode batch size after another: every bucket, padded or exact
    for n in (1, 2, 3, 5, 8, 13, 16):
        assert token_ids(graphs.generate(MIXED[:n], GREEDY)) == token_ids(eager.generate(MIXED[:n], GREEDY))


def test_a_prefix_cache_hit_equals_a_cold_run_on_cuda(gpu_model):
    shared = prompts([96], seed=1)[0]
    first, second = shared + prompts([9], 2)[0], shared + prompts([5], 3)[0]
    warm = llm(gpu_model, snapshot_interval=1)
    warm.generate([first], GREEDY)
    hit = warm.generate([second], GREEDY)
    assert warm.get_stats().prefix_cache_hits >= 80
    cold = llm(gpu_model, enable_prefix_caching=False).generate([second], GREEDY)
    assert token_ids(hit) == token_ids(cold)


def test_speculative_greedy_equals_plain_greedy_on_cuda(gpu_model):
    looping = build_model(TINY, torch.float32, seed=0, device=CUDA)
    with torch.no_grad():
        for layer in looping.model.layers.values():
            layer.self_attn.o_proj.weight.mul_(0.1)  # greedy text loops: drafts get accepted
    repetitive = [[24, 423] * 3, list(b"the cat sat on the mat. the cat sat on the mat. the cat")] + MIXED[:4]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = token_ids(llm(looping).generate(repetitive, params))
    ngram = llm(looping, speculative=SpeculativeConfig("ngram", 4))
    assert token_ids(ngram.generate(repetitive, params)) == plain
    assert ngram.get_stats().spec_accepted_tokens > 0
    draft = llm(looping, draft_model=build_model(TINY, torch.float32, seed=0, device=CUDA),
                speculative=SpeculativeConfig("draft", 3))
    assert token_ids(draft.generate(MIXED[:6], GREEDY)) == token_ids(llm(looping).generate(MIXED[:6], GREEDY))


def test_chunked_prefill_equals_whole_prefill_on_cuda(gpu_model):
    long_prompts = prompts([300, 41, 517], seed=4)
    whole = llm(gpu_model, max_num_batched_tokens=2048, enable_prefix_caching=False)
    chunked = llm(gpu_model, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert token_ids(chunked.generate(long_prompts, GREEDY)) == token_ids(whole.generate(long_prompts, GREEDY))


def test_seeded_sampling_on_cuda_is_reproducible(gpu_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    engine = llm(gpu_model)
    first = token_ids(engine.generate(MIXED[:5], params))
    assert token_ids(engine.generate(MIXED[:5], params)) == first
    assert token_ids(engine.generate(MIXED[:1], params)) == first[:1]  # the same whatever shares the batch
