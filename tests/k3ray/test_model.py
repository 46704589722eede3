"""Whole-model invariants of the tiny K3: caching, chunking and batching do not change logits."""

import pytest
import torch

import k3ray.models.k3 as k3_module
from k3ray.api import K3
from k3ray.config import k3_config, k3_tiny_config
from k3ray.engine import LLM, SamplingParams
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.init import build_model
from k3ray.models.k3 import K3ForCausalLM
from k3ray.models.moe import ExpertBackend

BS = 8  # small blocks so sequences span several


def run_chunks(model, ids, chunks, slot=0, cache=None, blocks=None):
    c = model.config
    cache = cache or ModelCache.allocate(c, 4, 64, BS, dtype=model.dtype)
    table = (blocks if blocks is not None else torch.arange(16))[None]
    out, pos = [], 0
    for n in chunks:
        b = ForwardBatch(torch.tensor([0, n]), torch.tensor([pos + n]), torch.tensor([slot]), table, cache)
        with torch.no_grad():
            out.append(model(ids[pos : pos + n], b))
        pos += n
    return torch.cat(out)


def max_rel(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.fixture(scope="module")
def tiny():
    return build_model(k3_tiny_config(), torch.float32, seed=0)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(3))


# fp32 rounding (2^-24 per op) through 9 layers of random weights grows to ~1e-6 of the logit
# scale; 1e-5 relative leaves 10x margin and still catches any state or cache bug (those are O(1)).
FP32_REL = 1e-5


def test_prefill_equals_token_by_token_decode(tiny, ids):
    whole = run_chunks(tiny, ids, [ids.numel()])
    steps = run_chunks(tiny, ids, [1] * ids.numel())
    assert max_rel(whole, steps) <= FP32_REL


@pytest.mark.parametrize("chunks", [[1, 44], [7, 38], [16, 16, 13], [30, 1, 1, 13], [44, 1]])
def test_split_prompt_with_state_carried_equals_unsplit(tiny, ids, chunks):
    whole = run_chunks(tiny, ids, [ids.numel()])
    assert max_rel(whole, run_chunks(tiny, ids, chunks)) <= FP32_REL


def test_batch_equals_each_sequence_alone(tiny):
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 256, (n,), generator=gen) for n in (13, 1, 29)]
    alone = [run_chunks(tiny, s, [s.numel()]) for s in seqs]
    c = tiny.config
    cache = ModelCache.allocate(c, 8, 64, BS)
    cache.kda_state[0].fill_(1e30)  # unused slots must never be read
    slots = torch.tensor([5, 2, 7])
    tables = torch.stack([torch.arange(10, 20), torch.arange(30, 40), torch.arange(40, 50)])
    cu = torch.tensor([0, 13, 14, 43])
    b = ForwardBatch(cu, torch.tensor([13, 1, 29]), slots, tables, cache)
    with torch.no_grad():
        batched = tiny(torch.cat(seqs), b)
    for i, ref in enumerate(alone):
        assert max_rel(ref, batched[cu[i] : cu[i + 1]]) <= FP32_REL
    # and a decode step for all three at once equals their separate decode steps
    nxt = torch.tensor([3, 4, 5])
    b2 = ForwardBatch(torch.tensor([0, 1, 2, 3]), torch.tensor([14, 2, 30]), slots, tables, cache)
    assert b2.is_decode
    with torch.no_grad():
        dec = tiny(nxt, b2)
    for i, s in enumerate(seqs):
        ref = run_chunks(tiny, torch.cat([s, nxt[i : i + 1]]), [s.numel(), 1])[-1]
        assert max_rel(ref, dec[i]) <= FP32_REL


def test_mixed_step_equals_each_sequence_alone(tiny):
    """A step with decodes beside prefill chunks (split onto the decode kernels) gives each sequence
    the logits it gets alone; a 1-token prompt (no cached prefix) stays on the prefill side."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (9, 17, 1, 12, 5)]
    new = [torch.randint(0, 256, (n,), generator=gen) for n in (1, 6, 1, 1, 3)]  # 1, 1: decodes
    cache = ModelCache.allocate(tiny.config, 8, 64, BS)
    slots = torch.tensor([3, 1, 6, 0, 4])
    tables = torch.stack([torch.arange(8 * i, 8 * i + 8) for i in range(5)])
    first = [0, 1, 3, 4]  # sequence 2's prompt arrives in the mixed step
    cu = torch.tensor([0] + [p.numel() for i, p in enumerate(prompts) if i in first]).cumsum(0)
    with torch.no_grad():
        tiny(torch.cat([prompts[i] for i in first]), ForwardBatch(
            cu, torch.tensor([prompts[i].numel() for i in first]), slots[first], tables[first], cache))
    chunks = [new[0], new[1], prompts[2], new[3], new[4]]
    cu = torch.tensor([0] + [c.numel() for c in chunks]).cumsum(0)
    lens = [prompts[i].numel() + new[i].numel() if i in first else 1 for i in range(5)]
    b = ForwardBatch(cu, torch.tensor(lens), slots, tables, cache)
    split = b.decode_split()
    assert not b.is_decode and split is not None
    assert split.decode.num_seqs == 2 and split.decode_rows.tolist() == [0, cu[3].item()]
    with torch.no_grad():
        mixed = tiny(torch.cat(chunks), b)
    for i in range(5):
        whole = torch.cat([prompts[i], new[i]]) if i in first else prompts[i]
        split_at = [prompts[i].numel(), new[i].numel()] if i in first else [1]
        ref = run_chunks(tiny, whole, split_at)[-chunks[i].numel():]
        assert max_rel(ref, mixed[cu[i] : cu[i + 1]]) <= FP32_REL, i


def test_bf16_model_tracks_fp32(ids):
    """Same (bf16-representable) weights, bf16 vs fp32 activations."""
    c = k3_tiny_config()
    m16 = build_model(c, torch.bfloat16, seed=0)
    m32 = build_model(c, torch.float32, seed=0)
    m32.load_state_dict({k: v.to(m32.state_dict()[k].dtype) for k, v in m16.state_dict().items()})
    a, b = run_chunks(m32, ids, [45]), run_chunks(m16, ids, [45]).float()
    per_token = (a - b).norm(dim=-1) / a.norm(dim=-1)
    # bf16 keeps 8 mantissa bits (~0.4% per op); through 9 random layers a few % per token is
    # expected, and a top-k routing flip makes a few tokens differ a lot, so bound the median
    assert per_token.median().item() < 0.1


def test_attn_res_source_counts_follow_k3_schedule(monkeypatch):
    """Simulate K3's 93-layer schedule (tiny widths): sources per AttnRes as in docs/k3-architecture.md §2."""
    c = k3_config().replace(
        hidden_size=16, vocab_size=300, intermediate_size=16, kda_num_heads=1, kda_head_dim=8, kda_a_log_size=8,
        mla_num_heads=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, routed_expert_hidden_size=32,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, vision=None,
    )
    model = build_model(c, torch.float32, seed=0)
    seen = []
    real = k3_module.attn_res_rmsnorm

    def record(sources, *args):
        seen.append(sources.shape[1])
        return real(sources, *args)

    monkeypatch.setattr(k3_module, "attn_res_rmsnorm", record)
    run_chunks(model, torch.tensor([5, 6, 7]), [3])
    # layer 0: FFN side only (2); then attention + FFN per layer; then the output AttnRes
    expected = [2]
    for layer in range(1, 93):
        blocks_before = 1 + (layer - 1) // 12  # bank rows before this layer's boundary push
        attn = blocks_before + 1
        ffn = attn + (1 if layer % 12 == 0 else 0)
        expected += [attn, ffn]
    expected.append(9)
    assert seen == expected
    assert seen[1 + 2 * 11 : 1 + 2 * 13] == [2, 3, 3, 3] and max(seen) == 9


def test_api_logits_and_loglikelihood(tiny, ids):
    k3 = K3(tiny, prefill_chunk=16)  # chunked internally
    logits = k3.logits(ids.tolist())
    assert max_rel(run_chunks(tiny, ids, [45]), logits) <= FP32_REL
    lp, greedy = k3.loglikelihood(ids[:20].tolist(), ids[20:25].tolist())
    ref = torch.log_softmax(logits, -1)[19:24].gather(-1, ids[20:25, None]).sum().item()
    assert lp == pytest.approx(ref, rel=1e-5) and greedy is False
    best = int(logits[19].argmax())
    assert k3.loglikelihood(ids[:20].tolist(), [best])[1] is True
    with pytest.raises(ValueError, match="outside the vocabulary"):
        k3.logits([1, 2, 99999])
    with pytest.raises(ValueError, match="non-empty"):
        k3.logits([])


def test_api_generate_greedy_matches_argmax_chain(tiny, ids):
    k3 = K3(tiny)
    out = k3.generate(ids[:10].tolist(), max_new_tokens=5, stop_token_ids=[])
    seq = ids[:10].tolist()
    for tok in out:
        assert tok == int(k3.logits(seq)[-1].argmax())
        seq.append(tok)
    sampled = k3.generate(ids[:10].tolist(), max_new_tokens=5, temperature=1.0, seed=7)
    assert sampled == k3.generate(ids[:10].tolist(), max_new_tokens=5, temperature=1.0, seed=7)
    with pytest.raises(ValueError, match="max_new_tokens"):
        k3.generate([1], max_new_tokens=0)


def test_api_generate_is_the_engines_generation(tiny, ids):
    """K3.generate runs the engine (LLM): the same tokens greedy and seeded, EOS and stop ids ending
    it; one engine serves its calls, built anew only for a longer request."""
    k3, llm = K3(tiny), LLM(tiny, enforce_eager=True)
    prompt = ids[:10].tolist()
    for params, kwargs in [(SamplingParams(temperature=0, max_tokens=6), {}),
                           (SamplingParams(temperature=1.0, seed=7, max_tokens=6), {"temperature": 1.0, "seed": 7})]:
        assert k3.generate(prompt, max_new_tokens=6, **kwargs) == llm.generate([prompt], params)[0].outputs[0].token_ids
    greedy = k3.generate(prompt, max_new_tokens=6)
    assert k3.generate(prompt, max_new_tokens=6, stop_token_ids=[greedy[2]]) == greedy[:3]
    engine = k3._engine
    k3.generate(prompt[:5], max_new_tokens=3)
    assert k3._engine is engine
    k3.generate(ids[:40].tolist(), max_new_tokens=60)
    assert k3._engine is not engine and k3._engine_blocks >= 2


def test_long_context_absorbed_prefill_equals_expanded(tiny, ids, monkeypatch):
    """The bounded-memory (absorbed, key-chunked) MLA prefill path gives the same logits."""
    import k3ray.models.mla as mla_module

    expanded = run_chunks(tiny, ids, [20, 25])
    monkeypatch.setattr(mla_module, "EXPANDED_PREFILL_MAX_SCORES", 0)
    absorbed = run_chunks(tiny, ids, [20, 25])
    assert max_rel(expanded, absorbed) <= FP32_REL


class ExpertsHeldElsewhere(ExpertBackend):
    """A layer's experts called, not owned (a plain dict is no submodule), as a pipeline stage's are."""

    def __init__(self, held: dict, layer_idx: int):
        super().__init__()
        self.held, self.layer_idx = held, layer_idx

    def forward(self, h, ids, weights):
        return self.held[self.layer_idx](h, ids, weights)


def test_experts_passed_in_are_the_only_experts(tiny, ids):
    """A model built with an experts factory allocates no routed expert tensors of its own, and
    equals the whole model when the backend computes the same experts."""
    held = {int(i): layer.block_sparse_moe.experts for i, layer in tiny.model.layers.items()
            if hasattr(layer, "block_sparse_moe")}
    assert held
    split = K3ForCausalLM(tiny.config, experts=lambda layer_idx: ExpertsHeldElsewhere(held, layer_idx))
    own = {k: v for k, v in tiny.state_dict().items() if ".block_sparse_moe.experts." not in k}
    assert set(split.state_dict()) == set(own)
    split.load_state_dict(own)
    assert torch.equal(run_chunks(split.eval(), ids, [20, 25]), run_chunks(tiny, ids, [20, 25]))
    with pytest.raises(ValueError, match="not both"):
        K3ForCausalLM(tiny.config, expert_range=(0, 1), experts=lambda layer_idx: ExpertsHeldElsewhere(held, layer_idx))
