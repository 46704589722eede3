"""Continuous batching and chunked prefill against the model itself (the oracle: the argmax of
K3.logits over the whole sequence, token by token, no engine and no cache carried between tokens)."""

from dataclasses import replace

import pytest
import torch

from k3ray.api import K3
from k3ray.config import preset
from k3ray.engine import LLM, LLMEngine, LocalExecutor, SamplingParams
from k3ray.engine.config import EngineConfig
from k3ray.engine.execution.plan import pad_block_tables
from k3ray.engine.outputs import OutputAccumulator
from k3ray.models.init import build_model
from k3ray.sampling_params import RequestOutputKind

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# k3-tiny's layer kinds at 4 layers (3 KDA, 1 MLA, one MoE layer): engine logic, not model math
MICRO = preset("k3-micro")


@pytest.fixture(scope="module")
def model():
    return build_model(MICRO, seed=0)


def random_prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


class RecordingExecutor(LocalExecutor):
    """The real local executor, also recording each step's shape."""

    def __init__(self, model):
        super().__init__(model)
        self.tokens_per_step, self.seqs_per_step = [], []

    def execute(self, plan):
        self.tokens_per_step.append(sum(b.input_ids.numel() for b in plan.batches))
        self.seqs_per_step.append(sum(b.state_slots.numel() for b in plan.batches))
        return super().execute(plan)


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[str(i)] for i in range(len(prompts))]


def greedy_oracle(model, prompt: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Each next token the argmax of the whole sequence's logits; EOS included, and it ends."""
    k3, seq, out = K3(model), list(prompt), []
    while len(out) < max_new_tokens:
        out.append(int(k3.logits(seq)[-1].argmax()))
        seq.append(out[-1])
        if stop_at_eos and out[-1] == model.config.eos_token_id:
            break
    return out


def test_greedy_equals_the_model_oracle():
    model = build_model(preset("k3-tiny"), seed=0)
    prompts = random_prompts([1, 30])
    expected = [greedy_oracle(model, p, 8) for p in prompts]
    outs = LLM(model, num_blocks=64, block_size=8).generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert token_ids(outs) == expected


def test_a_batch_equals_each_sequence_alone(model):
    prompts = random_prompts([3, 9, 16, 25, 40, 7], seed=1)
    llm = LLM(model, num_blocks=128, block_size=8, enable_prefix_caching=False)
    together = token_ids(llm.generate(prompts, GREEDY))
    alone = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("chunk", [1, 3, 8, 13])
def test_chunked_prefill_equals_whole_prefill(model, chunk):
    prompt = random_prompts([45], seed=2)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    whole = LLM(model, num_blocks=32, block_size=8, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chunked = LLM(model, num_blocks=32, block_size=8, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    a, b = whole.generate([prompt], params)[0], chunked.generate([prompt], params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp_a = torch.tensor([d[t].logprob for d, t in zip(a.prompt_logprobs[1:], prompt[1:])])
    lp_b = torch.tensor([d[t].logprob for d, t in zip(b.prompt_logprobs[1:], prompt[1:])])
    # fp32, chunk boundaries only reorder sums (measured ~2e-5 on log-probs of magnitude ~6)
    torch.testing.assert_close(lp_b, lp_a, atol=1e-4, rtol=0)


def test_prompt_logprobs_equal_the_full_sequence_log_softmax(model):
    prompt = random_prompts([30], seed=3)[0]
    out = LLM(model, num_blocks=16, block_size=8, max_num_batched_tokens=7).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    logp = torch.log_softmax(K3(model).logits(prompt), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[pos], logp[pos - 1]
        assert set(row.topk(2).indices.tolist()) <= set(entry)
        # fp32; chunked engine prefill vs one whole-sequence forward (sum order only)
        assert entry[prompt[pos]].logprob == pytest.approx(float(row[prompt[pos]]), abs=1e-4)


def test_token_budget_and_max_num_seqs_bound_every_step(model):
    executor = RecordingExecutor(model)
    engine = LLMEngine(executor, EngineConfig(max_num_seqs=3, max_num_batched_tokens=12, num_blocks=64, block_size=4))
    prompts = random_prompts([30, 2, 11, 5, 19, 8], seed=4)
    outs = run(engine, prompts, GREEDY)
    assert max(executor.tokens_per_step) <= 12
    assert max(executor.seqs_per_step) <= 3
    alone = LLM(model, num_blocks=64, block_size=4)
    assert token_ids(outs) == [token_ids(alone.generate([p], GREEDY))[0] for p in prompts]


def test_a_long_prompt_runs_in_bounded_chunks(model):
    prompt = random_prompts([400], seed=5)[0]
    executor = RecordingExecutor(model)
    engine = LLMEngine(executor, EngineConfig(max_num_batched_tokens=128, num_blocks=64, block_size=8,
                                              enable_prefix_caching=False))
    out = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert max(executor.tokens_per_step) == 128
    assert out.outputs[0].token_ids == greedy_oracle(model, prompt, 4, stop_at_eos=False)


def test_preemption_by_recompute_gives_the_same_tokens(model):
    prompts = random_prompts([20, 14, 26, 9], seed=6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    # 14 blocks of 4 tokens cannot hold four ~28-token sequences: the newest get preempted
    small = LLMEngine(LocalExecutor(model), EngineConfig(max_num_seqs=4, num_blocks=14, block_size=4,
                                                         max_num_batched_tokens=64))
    outs = run(small, prompts, params)
    assert small.get_stats().num_preemptions > 0
    roomy = LLM(model, num_blocks=128, block_size=4, enable_prefix_caching=False)
    assert token_ids(outs) == [token_ids(roomy.generate([p], params))[0] for p in prompts]
    usage = small.get_stats().cache
    assert usage["blocks_used"] == 0 and usage["state_slots_live"] == 0


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    prompt = random_prompts([12], seed=7)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=8, ignore_eos=True)
    llm = LLM(model, num_blocks=64, block_size=8)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    crowd = random_prompts([5, 30, 9], seed=8)
    mixed = llm.generate(crowd[:2] + [prompt] + crowd[2:],
                         [SamplingParams(temperature=0.7, max_tokens=5)] * 2 + [params] + [GREEDY])
    assert mixed[2].outputs[0].token_ids == alone
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == alone


def test_cache_accounting_is_exact(model):
    from k3ray.engine import SpeculativeConfig

    budget = 3 * 1024**2
    executor = LocalExecutor(model, build_model(MICRO, seed=1))
    engine = LLMEngine(executor, EngineConfig(max_num_seqs=4, cache_memory_bytes=budget, block_size=8,
                                              speculative=SpeculativeConfig("draft", 2)))
    usage = engine.cache.usage()
    allocated = sum(sum(c.nbytes().values()) for c in (executor.cache, executor.draft_cache))
    assert usage["bytes_total"] == allocated
    assert budget - usage["block_bytes"] < allocated <= budget  # blocks take all the rest
    assert usage["state_slots_total"] == 4 * (1 + 3) + 4  # live + scratch per sequence, + snapshots
    engine.add_request("a", list(range(1, 30)), GREEDY)
    engine.step()
    usage = engine.cache.usage()
    # the first chunk stops at the prompt's last full block (a snapshot boundary): 24 tokens, 3 blocks
    assert usage["state_slots_live"] == 4 and usage["blocks_used"] == 3 and usage["state_slots_snapshot"] == 1
    assert usage["bytes_used"] == 5 * usage["state_slot_bytes"] + 3 * usage["block_bytes"]


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_final_only_and_delta_outputs_give_the_same_final_outputs(model, kind):
    """FINAL_ONLY (what LLM.generate asks for) skips the unfinished requests' outputs and nothing else;
    DELTA outputs carry each step's new token only and add up to the same finals."""
    prompts = random_prompts([5, 9, 2], seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = run(LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=64, block_size=4)), prompts, params)
    engine = LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=64, block_size=4))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, replace(params, output_kind=kind))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    if kind is RequestOutputKind.FINAL_ONLY:
        assert all(o.finished for o in seen)
    else:
        assert all(len(o.outputs[0].token_ids) == 1 for o in seen)
    finals = {}
    for o in seen:
        finals.setdefault(o.request_id, OutputAccumulator()).add(o)
    assert sorted(finals) == ["0", "1", "2"]
    assert token_ids([finals[str(i)].output() for i in range(3)]) == token_ids(plain)


def test_block_tables_pad_with_zeros():
    tables = pad_block_tables([[3, 1], [], [7, 8, 9]])
    assert tables.dtype == torch.int32 and tables.tolist() == [[3, 1, 0], [0, 0, 0], [7, 8, 9]]
    assert pad_block_tables([[]]).shape == (1, 1) and pad_block_tables([]).shape == (0, 1)
