"""Speculative decoding: greedy output must equal plain greedy exactly (n-gram drafts and a draft
model), drafts must be accepted on repetitive text, and sampled verification keeps the target
distribution."""

import pytest
import torch

from k3ray.config import preset
from k3ray.engine import LLM, SamplingParams, SpeculativeConfig
from k3ray.engine.sample.spec import lookup, verify
from k3ray.models.init import build_model

MICRO = preset("k3-micro")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_model(MICRO, seed=0)


@pytest.fixture(scope="module")
def looping_model():
    """k3-tiny with every attention output scaled by 0.1: greedy decoding falls into short loops
    (repetitive text), while each token still depends on the cached KDA state and MLA latents."""
    m = build_model(preset("k3-tiny"), seed=0)
    with torch.no_grad():
        for layer in m.model.layers.values():
            layer.self_attn.o_proj.weight.mul_(0.1)
    return m


def prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[5, 6, 7, 8, 9] * 4] + [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 21)]


def llm(model, **kw):
    return LLM(model, num_blocks=64, block_size=8, max_num_seqs=4, **kw)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_lookup_proposes_what_followed_the_latest_match():
    import numpy as np

    t = np.array([1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    assert lookup(t, 3, 1, 3) == [4, 5, 1]  # "1 2" last seen at 4..5, followed by 4 5 1
    assert lookup(t, 1, 1, 1) == [4]
    assert lookup(np.array([7, 8]), 2, 1, 3) == []


def test_ngram_greedy_equals_plain_greedy(model):
    plain = token_ids(llm(model).generate(prompts(), GREEDY))
    spec = llm(model, speculative=SpeculativeConfig("ngram", 3))
    assert token_ids(spec.generate(prompts(), GREEDY)) == plain
    assert spec.get_stats().spec_draft_tokens > 0  # drafts were proposed (and here all rejected)


def test_ngram_accepts_drafts_on_repetitive_text(looping_model):
    prompt = [[24, 423] * 3, list(b"the cat sat on the mat. the cat sat on the mat. the cat")]
    plain = token_ids(llm(looping_model).generate(prompt, GREEDY))
    spec = llm(looping_model, speculative=SpeculativeConfig("ngram", 4))
    assert token_ids(spec.generate(prompt, GREEDY)) == plain
    stats = spec.get_stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # acceptances and rollbacks both ran


def test_identical_draft_model_is_always_accepted(model):
    plain = token_ids(llm(model).generate(prompts(), GREEDY))
    spec = llm(model, draft_model=build_model(MICRO, seed=0), speculative=SpeculativeConfig("draft", 3))
    assert token_ids(spec.generate(prompts(), GREEDY)) == plain
    assert spec.get_stats().spec_acceptance_rate == 1.0


def test_a_different_draft_model_is_partly_accepted(model):
    draft = build_model(MICRO, seed=0)
    with torch.no_grad():  # a noisy copy: agrees with the target on some tokens, not all
        gen = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std())
    plain = token_ids(llm(model).generate(prompts(), GREEDY))
    spec = llm(model, draft_model=draft, speculative=SpeculativeConfig("draft", 3))
    assert token_ids(spec.generate(prompts(), GREEDY)) == plain
    assert 0 < spec.get_stats().spec_acceptance_rate < 1


def test_a_smaller_draft_model_works(model):
    small = preset("k3-tiny").replace(name="k3-draft", num_layers=2, layer_types=("kda", "mla"))
    plain = token_ids(llm(model).generate(prompts(), GREEDY))
    spec = llm(model, draft_model=build_model(small, seed=3), speculative=SpeculativeConfig("draft", 2))
    assert token_ids(spec.generate(prompts(), GREEDY)) == plain


def test_speculation_respects_stops_limits_and_the_prefix_cache(looping_model):
    params = [SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[51]) for n in (1, 5, 13)]
    prompt = [[209, 402, 51] * 3 + [209]] * 3
    plain = llm(looping_model).generate(prompt, params)
    spec = llm(looping_model, speculative=SpeculativeConfig("ngram", 4), snapshot_interval=1)
    for _ in range(2):  # the second pass resumes from the prefix cache
        outs = spec.generate(prompt, params)
        assert token_ids(outs) == token_ids(plain)
        assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in plain]
    assert spec.get_stats().prefix_cache_hits > 0
    usage = spec.get_stats().cache
    assert usage["blocks_used"] == 0 and usage["state_slots_live"] == 0


def test_sampled_speculation_is_reproducible_with_a_seed(looping_model):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
    prompt = [[24, 423] * 3]
    spec = llm(looping_model, speculative=SpeculativeConfig("ngram", 3))
    first = token_ids(spec.generate(prompt, params))
    assert token_ids(spec.generate(prompt, params)) == first
    assert len(first[0]) == 16


def test_verification_keeps_the_target_distribution():
    # position 0: target p0 over 4 tokens; the draft proposes token 1
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    n = 6000
    first = torch.tensor([verify(logits, [1], params, gen)[0] for _ in range(n)])
    freq = torch.bincount(first, minlength=4).float() / n
    p = torch.tensor([0.1, 0.5, 0.3, 0.1])
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma).all(), freq  # 5 sigma: a false alarm is ~1e-6
