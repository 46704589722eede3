"""Long context beside short requests (EngineConfig.long_prefill_token_threshold): a long prompt's
prefill never locks shorter requests out — it takes at most half the step budget while they wait,
one long prompt prefills at a time, long sequences leave the cache reserve to the rest — and the
outputs are the tokens each request gets alone."""

import pytest
import torch

from k3ray.config import preset
from k3ray.engine import EngineConfig, LLMEngine, LocalExecutor, SamplingParams
from k3ray.models.init import build_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# 64 blocks of 8 tokens (512); prompts over 64 tokens are long; long sequences leave 128 tokens to the rest
LANES = dict(max_num_seqs=8, max_num_batched_tokens=32, num_blocks=64, block_size=8, enable_prefix_caching=False,
             long_prefill_token_threshold=64, long_context_reserve=128)


@pytest.fixture(scope="module")
def model():
    return build_model(preset("k3-micro"), seed=0)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_with(model, **overrides) -> LLMEngine:
    return LLMEngine(LocalExecutor(model), EngineConfig(**{**LANES, **overrides}))


def step_until_done(engine, on_step=None) -> dict[str, list[int]]:
    finals, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        step += 1
        if on_step is not None:
            on_step(step)
    return finals


def first_token_steps(engine, arrivals: dict[str, int], prompts: dict[str, list[int]]) -> dict[str, int]:
    """Add each request at its step; -> steps from arrival to its first output."""
    waited, step, outputs = {}, 0, {}
    while len(outputs) < len(arrivals) or engine.has_unfinished_requests():
        for rid, at in arrivals.items():
            if at == step:
                engine.add_request(rid, prompts[rid], GREEDY)
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in waited:
                waited[out.request_id] = step - arrivals[out.request_id]
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    return waited


def test_short_requests_get_their_first_token_while_a_long_prompt_prefills(model):
    engine = engine_with(model)
    prompts = {"long": prompt(360, 0), **{f"short{i}": prompt(10, i + 1) for i in range(3)}}
    waited = first_token_steps(engine, {"long": 0, "short0": 2, "short1": 3, "short2": 5}, prompts)
    # before: the long prompt took the whole budget until its prefill was done (~11 steps)
    assert all(waited[f"short{i}"] <= 1 for i in range(3)), waited
    assert waited["long"] <= 360 // 16 + 2  # it still gets half of each step while the short ones prefill


def test_one_long_prompt_prefills_at_a_time_and_shorter_ones_go_past(model):
    engine = engine_with(model)
    for rid, n in (("long0", 200), ("long1", 200), ("short", 20)):
        engine.add_request(rid, prompt(n, len(rid)), GREEDY)
    long_prefills = []

    def watch(step):
        running = engine.scheduler.running
        long_prefills.append(sum(1 for s in running if s.prompt_len > 64 and 0 < s.num_computed_tokens < s.prompt_len))

    first = engine.step()  # the short prompt is admitted beside long0, past long1
    assert [s.request.request_id for s in engine.scheduler.running] == ["long0", "short"]
    assert engine.scheduler.running[0].num_computed_tokens == 16  # half the budget: the short one waited
    assert first == [] or all(o.request_id == "short" for o in first)
    step_until_done(engine, watch)
    assert max(long_prefills) == 1


def test_long_sequences_leave_the_reserve_to_shorter_ones(model):
    engine = engine_with(model)
    assert engine.max_model_len == 512 - 128 and engine.scheduler.long_block_cap == 48
    long_prompt = prompt(380, 7)
    shorts = {f"short{i}": prompt(40, 10 + i) for i in range(6)}
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    held = []

    def watch(step):
        held.append(sum(len(s.block_table) for s in engine.scheduler.running if s.num_tokens > 64))
        if step == 10:  # the long prompt holds most of the cache: six short ones still run beside it
            for rid, p in shorts.items():
                engine.add_request(rid, p, GREEDY)

    finals = step_until_done(engine, watch)
    assert max(held) <= 48 and engine.scheduler.num_preemptions == 0
    alone = LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=64, block_size=8, enable_prefix_caching=False))
    for rid, p in {"long": long_prompt, **shorts}.items():
        alone.add_request(rid, p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert step_until_done(alone) == finals


def test_an_explicit_max_model_len_shrinks_the_reserve(model):
    engine = engine_with(model, max_model_len=448)
    assert engine.max_model_len == 448 and engine.scheduler.long_block_cap == 56
    default = LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=64, block_size=8))
    assert default.max_model_len == 512  # a cache under four long prompts keeps no reserve
    with pytest.raises(ValueError, match="long_context_reserve"):
        EngineConfig(long_context_reserve=-1)


def test_stats_report_each_lanes_backlog_and_measured_rates(model):
    engine = engine_with(model)
    engine.add_request("long", prompt(300, 0), GREEDY)
    engine.add_request("short", prompt(10, 1), GREEDY)
    stats = engine.get_stats()
    assert (stats.prefill_backlog_tokens, stats.long_prefill_backlog_tokens) == (10, 300)
    assert stats.prefill_tok_s is None and stats.long_prefill_tok_s is None
    engine.step()  # short: 10 tokens; long: 16 (half of the 32-token budget, as the short one waited)
    stats = engine.get_stats()
    assert (stats.prefill_backlog_tokens, stats.long_prefill_backlog_tokens) == (0, 284)
    assert stats.prefill_tok_s > 0 and stats.long_prefill_tok_s > 0 and stats.decode_tok_s is None
    step_until_done(engine)
    stats = engine.get_stats()
    assert (stats.prefill_backlog_tokens, stats.long_prefill_backlog_tokens) == (0, 0) and stats.decode_tok_s > 0
