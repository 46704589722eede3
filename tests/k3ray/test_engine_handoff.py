"""Prefill/decode disaggregation in the engine: a prefill engine runs the prompt and hands its caches
(MLA latent rows, KDA / conv state) and first token to a decode engine, which continues. The output
must equal one engine's token for token, with a prefix the decode side already holds, chunked
prefill, speculative decoding on the decode side, seeded sampling and log-probs; a handoff that can
no longer be written fails only its request, and nothing is left held on either side."""

from dataclasses import replace

import pytest
import torch

from k3ray.config import preset
from k3ray.engine import LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.config import EngineConfig, SpeculativeConfig
from k3ray.engine.core.cache_manager import block_bytes, state_slot_bytes
from k3ray.engine.disagg.handoff import HandoffMismatchError
from k3ray.models.init import build_model
from k3ray.sampling_params import RequestOutputKind
from k3ray.testing import finish_request

MICRO = preset("k3-micro")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BS = 8


@pytest.fixture(scope="module")
def model():
    return build_model(MICRO, seed=0)


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, **kw):
    config = dict(max_num_seqs=4, num_blocks=96, block_size=BS, snapshot_interval=2)
    config.update(kw)
    return LLMEngine(LocalExecutor(model), EngineConfig(**config))




def colocated(model, prompt, params, **kw):
    e = engine(model, **kw)
    e.add_request("r", prompt, params)
    return finish_request(e, "r").outputs[0]


def prefill(prefill_engine, request_id, prompt, params, export_from):
    only_final = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    prefill_engine.add_request(request_id, prompt, only_final, export_from=export_from)
    out = finish_request(prefill_engine, request_id)
    assert out.outputs[0].finish_reason in ("handoff", "stop", "length")
    return out.handoff


def disaggregated(prefill_engine, decode_engine, request_id, prompt, params):
    """The orchestration a decode replica does: ask what it holds, have the rest prefilled, continue."""
    held = decode_engine.held_prefix_tokens(prompt)
    handoff = prefill(prefill_engine, request_id, prompt, params, held).pack()  # as it crosses Ray
    decode_engine.add_request(request_id, prompt, params, handoff=handoff)
    return finish_request(decode_engine, request_id).outputs[0], handoff


def assert_nothing_held(e):
    assert not e.has_unfinished_requests()
    assert e.cache.states.num_live == 0
    assert sum(e.cache.blocks.ref) == 0
    assert not e.handoffs.waiting


def test_disaggregated_greedy_equals_one_engine(model):
    p, d = engine(model), engine(model)
    for i, n in enumerate((5, 8, 37, 64)):  # under a block, one block, mid-block, whole blocks
        prompt = tokens(n, i)
        out, handoff = disaggregated(p, d, f"g{i}", prompt, GREEDY)
        assert out.token_ids == colocated(model, prompt, GREEDY).token_ids
        assert handoff.start == 0
    assert_nothing_held(p)
    assert_nothing_held(d)


def test_seeded_sampling_and_logprobs_continue_from_the_prefill_sides_sampler(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1, presence_penalty=0.5)
    prompt = tokens(29, 3)
    out, _ = disaggregated(engine(model), engine(model), "s", prompt, params)
    ref = colocated(model, prompt, params)
    assert out.token_ids == ref.token_ids
    assert out.logprobs == ref.logprobs
    assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob)


def test_a_prefix_the_decode_side_holds_is_not_sent_again(model):
    p, d = engine(model), engine(model)
    shared = tokens(40, 4)
    first, second = shared + tokens(9, 5), shared + tokens(6, 6)
    out1, h1 = disaggregated(p, d, "a", first, GREEDY)
    out2, h2 = disaggregated(p, d, "b", second, GREEDY)
    assert h1.start == 0 and h2.start == 40  # five whole shared blocks were already on the decode side
    assert out1.token_ids == colocated(model, first, GREEDY).token_ids
    assert out2.token_ids == colocated(model, second, GREEDY).token_ids
    # the same prompt again: everything but the block holding its last token
    out3, h3 = disaggregated(p, d, "c", second, GREEDY)
    assert h3.start == (len(second) - 1) // BS * BS and out3.token_ids == out2.token_ids
    assert_nothing_held(d)


def test_handoff_bytes_are_the_latent_rows_sent_plus_one_state(model):
    p, d = engine(model), engine(model)
    prompt = tokens(53, 7)
    _, handoff = disaggregated(p, d, "x", prompt, GREEDY)
    sizes = handoff.unpack().nbytes()
    assert sizes["state"] == state_slot_bytes(MICRO, torch.float32)
    assert sizes["mla_latent"] == block_bytes(MICRO, 1, torch.float32) * len(prompt)


@pytest.mark.parametrize("side", ["chunked prefill", "speculative decode", "no prefix caching"])
def test_engine_variants_on_either_side(model, side):
    kw_p, kw_d = {}, {}
    if side == "chunked prefill":
        kw_p = dict(max_num_batched_tokens=8)
    elif side == "speculative decode":
        kw_d = dict(speculative=SpeculativeConfig("ngram", 3, ngram_min=1, ngram_max=2))
    else:
        kw_p = kw_d = dict(enable_prefix_caching=False)
    p, d = engine(model, **kw_p), engine(model, **kw_d)
    repeating = tokens(12, 8) * 4  # n-gram drafts get accepted
    for i, prompt in enumerate((repeating, tokens(45, 9))):
        out, _ = disaggregated(p, d, f"v{i}", prompt, replace(GREEDY, max_tokens=12))
        assert out.token_ids == colocated(model, prompt, replace(GREEDY, max_tokens=12)).token_ids
    if side == "speculative decode":
        assert d.stats.spec_verifications > 0
    assert_nothing_held(p)
    assert_nothing_held(d)


def test_a_first_token_that_ends_the_request_ends_it_on_the_decode_side(model):
    prompt = tokens(20, 10)
    one = replace(GREEDY, max_tokens=1)
    out, _ = disaggregated(engine(model), d := engine(model), "one", prompt, one)
    assert out.token_ids == colocated(model, prompt, one).token_ids and out.finish_reason == "length"
    assert_nothing_held(d)


def test_a_prefix_evicted_before_the_handoff_arrives_fails_only_that_request(model):
    p, d = engine(model), engine(model)
    prompt = tokens(33, 11)
    disaggregated(p, d, "warm", prompt, GREEDY)
    held = d.held_prefix_tokens(prompt)
    assert held == 32
    handoff = prefill(p, "late", prompt, GREEDY, held)
    d.reset_prefix_cache()  # what eviction does between the question and the handoff
    d.add_request("other", tokens(10, 12), GREEDY)
    d.add_request("late", prompt, GREEDY, handoff=handoff)
    with pytest.raises(HandoffMismatchError, match="no longer cached"):
        finish_request(d, "late")
    assert_nothing_held(d)
    # the sender's retry: the whole prompt
    out, h = disaggregated(p, d, "late", prompt, GREEDY)
    assert h.start == 0 and out.token_ids == colocated(model, prompt, GREEDY).token_ids


def test_a_handoff_waits_for_room_and_can_be_aborted_while_it_waits(model):
    p, d = engine(model), engine(model, max_num_seqs=1)
    d.add_request("busy", tokens(9, 13), replace(GREEDY, max_tokens=30))
    d.step()
    prompt = tokens(17, 14)
    handoff = prefill(p, "w", prompt, GREEDY, 0)
    d.add_request("w", prompt, GREEDY, handoff=handoff)
    d.step()
    assert d.handoffs.waiting  # no sequence slot free: it waits, counted as waiting (the decode pool scales on it)
    assert d.get_stats().num_waiting == 1
    final = d.abort_request("w")
    assert final.outputs[0].finish_reason == "abort"
    d.abort_request("busy")
    assert_nothing_held(d)
    d.add_request("w2", prompt, GREEDY, handoff=prefill(p, "w2", prompt, GREEDY, 0))
    assert finish_request(d, "w2").outputs[0].token_ids == colocated(model, prompt, GREEDY).token_ids


def test_bad_handoff_requests_are_refused(model):
    e = engine(model)
    with pytest.raises(ValueError, match="multiple of block_size"):
        e.add_request("a", tokens(20, 15), GREEDY, export_from=3)
    with pytest.raises(ValueError, match="one sequence"):
        e.add_request("b", tokens(20, 15), replace(GREEDY, n=2), export_from=0)
    handoff = prefill(engine(model), "c", tokens(20, 15), GREEDY, 0)
    with pytest.raises(HandoffMismatchError, match="another prompt"):
        e.add_request("c", tokens(21, 15), GREEDY, handoff=handoff)
    assert not e.has_unfinished_requests()


def prefill_in_parts(prefill_engine, request_id, prompt, params, export_from):
    """Export with parts (delta outputs): the parts as they came, and the final handoff."""
    delta = replace(params, output_kind=RequestOutputKind.DELTA)
    prefill_engine.add_request(request_id, prompt, delta, export_from=export_from, export_parts=True)
    parts, final = [], None
    while final is None:
        for out in prefill_engine.step():
            assert out.request_id == request_id
            parts += out.handoff_parts
            if out.finished:
                final = out
    assert not final.handoff_parts  # the last chunk's rows are in the handoff itself
    return parts, final.handoff


@pytest.mark.parametrize("held", [0, 16])
def test_parts_sent_while_later_chunks_run_join_into_the_whole_handoff(model, held):
    prompt = tokens(61, 11)
    chunked = dict(max_num_batched_tokens=16, snapshot_interval=2)
    d = engine(model)
    if held:
        d.add_request("warm", prompt[:held + 1], GREEDY)
        finish_request(d, "warm")
        assert d.held_prefix_tokens(prompt) == held
    parts, final = prefill_in_parts(engine(model, **chunked), "p", prompt, GREEDY, held)
    # one part a chunk but the last (chunks of at most 16 tokens), each the rows its chunk computed
    ends = [held] + [p.rows_to for p in parts]
    assert [p.rows_from for p in parts] == ends[:-1] and all(0 < b - a <= 16 for a, b in zip(ends, ends[1:]))
    assert len(parts) >= 2 and final.rows_from == ends[-1] and len(prompt) - 16 <= final.rows_from < len(prompt)
    whole = prefill(engine(model, **chunked), "w", prompt, GREEDY, held)
    joined = final.pack().joined([p.pack() for p in parts])  # as they cross Ray
    for got, want in zip(joined.records, whole.records):
        for kind in ("kda_state", "conv_state", "mla_latent"):
            for layer, t in getattr(want, kind).items():
                assert torch.equal(getattr(got, kind)[layer], t), (kind, layer)
    sizes = sum(p.nbytes() for p in parts) + final.unpack().nbytes()["mla_latent"]
    assert sizes == block_bytes(MICRO, 1, torch.float32) * (len(prompt) - held)
    d.add_request("p", prompt, GREEDY, handoff=joined)
    assert finish_request(d, "p").outputs[0].token_ids == colocated(model, prompt, GREEDY).token_ids
    assert_nothing_held(d)


def test_parts_must_be_joined_whole_and_in_order(model):
    prompt = tokens(61, 12)
    parts, final = prefill_in_parts(engine(model, max_num_batched_tokens=16), "p", prompt, GREEDY, 0)
    assert len(parts) >= 3
    with pytest.raises(HandoffMismatchError, match="does not continue"):
        final.joined([parts[0], parts[2]])
    with pytest.raises(HandoffMismatchError, match=f"end at row {parts[-2].rows_to}"):
        final.joined(parts[:-1])
    d = engine(model)
    with pytest.raises(HandoffMismatchError, match="join the parts"):
        d.add_request("p", prompt, GREEDY, handoff=final)  # the rows before its own never came
    assert_nothing_held(d)
    e = engine(model)
    with pytest.raises(ValueError, match="DELTA"):
        e.add_request("q", prompt, GREEDY, export_from=0, export_parts=True)
    with pytest.raises(ValueError, match="needs export_from"):
        e.add_request("q", prompt, replace(GREEDY, output_kind=RequestOutputKind.DELTA), export_parts=True)
    # a prompt in one chunk (no snapshot boundaries to end chunks at) has no parts: its handoff is whole
    parts, final = prefill_in_parts(engine(model, enable_prefix_caching=False), "one", prompt, GREEDY, 0)
    assert parts == [] and final.rows_from is None
