"""logit_bias, repetition / frequency / presence penalties, min_p and best_of: the processed logits
against tensors computed by hand, then through the engine against a greedy reference that applies
vLLM's formulas one element at a time to the model's own logits."""

import pytest
import torch

from k3ray.api import K3
from k3ray.engine import SamplingParams
from k3ray.engine.structured.logits_processors import apply_penalties, process_logits, token_counts

PENALTIES = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.7)


def reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's order, one element at a time: bias, repetition (prompt + output), frequency, presence."""
    out = list(logits)
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    for token in range(len(out)):
        if token in prompt or token in output:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def test_penalties_equal_the_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # prompt [1, 4]: repetition only; output [3, 3, 2]: repetition, 2 x frequency / 1 x frequency, presence
    got = apply_penalties(logits, [params], [[1, 4]], [[3, 3, 2]])
    want = torch.tensor([[2.0, -2.0, 0.25 - 0.5 - 0.25, 1.5 - 1.0 - 0.25, -4.0, 1.0]])
    torch.testing.assert_close(got, want)


def test_logit_bias_then_penalties_batched_rows_equal_each_row_alone():
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logit_bias={"2": 5.0, 7: -100.0}, **PENALTIES), SamplingParams(),
              SamplingParams(logit_bias={0: 1.5}, repetition_penalty=0.8)]
    token_ids = [[1, 2, 2, 9, 7, 7], [1, 2, 3], [4, 0, 0, 5]]
    prompt_lens = [2, 1, 3]
    got = process_logits(logits, params, token_ids, prompt_lens)
    for i, (p, ids, n) in enumerate(zip(params, token_ids, prompt_lens)):
        torch.testing.assert_close(got[i], torch.tensor(reference(logits[i].tolist(), p, ids[:n], ids[n:])))
        torch.testing.assert_close(got[i], process_logits(logits[i : i + 1], [p], [ids], [n])[0])
    assert torch.equal(got[1], logits[1])  # a row that asks for nothing is untouched


def test_token_counts():
    counts = token_counts([[1, 1, 3], []], 5, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0, 0, 0, 0, 0]]


@pytest.mark.parametrize("kwargs, match", [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 2\]"),
    ({"logit_bias": {1: 101}}, r"logit_bias values must be in \[-100, 100\]"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {-1: 1}}, "logit_bias key must be >= 0"),
    ({"n": 3, "best_of": 2}, "best_of must be >= n"),
])
def test_bad_controls_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_ids_must_be_in_the_vocabulary():
    with pytest.raises(ValueError, match=r"logit_bias token ids \[600\] are outside the vocabulary \[0, 512\)"):
        SamplingParams(logit_bias={600: 1.0}).validate(vocab_size=512, max_model_len=64)


def test_engine_greedy_with_penalties_follows_the_reference(micro_llm, micro_model):
    prompt = [5, 50, 150, 250, 50]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={65: 0.3}, **PENALTIES)
    got = micro_llm.generate([prompt], params)[0].outputs[0].token_ids
    plain = micro_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert got != plain.outputs[0].token_ids  # the controls change this greedy output
    rows = K3(micro_model).logits(prompt + got)[len(prompt) - 1 :]
    for i, token in enumerate(got):
        want = torch.tensor(reference(rows[i].tolist(), params, prompt, got[:i]))
        assert want[token] >= want.max() - 1e-4  # the argmax (up to fp32 sum order)


def test_engine_logit_bias_forces_and_bans_tokens(micro_llm):
    forced = micro_llm.generate(["Hi"], SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True,
                                                 logit_bias={65: 100}))[0].outputs[0]
    assert forced.text == "AAAAA"
    banned = set(range(256, 512))  # every special and reserved id
    out = micro_llm.generate(["Hi"], SamplingParams(seed=2, max_tokens=6, logit_bias={t: -100 for t in banned}))[0]
    assert not banned & set(out.outputs[0].token_ids)


def test_min_p_one_keeps_only_the_argmax(micro_llm):
    kw = dict(max_tokens=6, ignore_eos=True)
    greedy = micro_llm.generate(["Hello"], SamplingParams(temperature=0, **kw))[0].outputs[0].token_ids
    sampled = micro_llm.generate(["Hello"], SamplingParams(temperature=1.0, min_p=1.0, seed=3, **kw))[0]
    assert sampled.outputs[0].token_ids == greedy


def test_best_of_returns_the_n_most_likely_of_its_samples(micro_llm):
    kw = dict(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    every = micro_llm.generate(["Ray"], SamplingParams(n=4, logprobs=0, **kw))[0].outputs
    best = micro_llm.generate(["Ray"], SamplingParams(n=2, best_of=4, **kw))[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert best[0].cumulative_logprob is None  # no logprobs asked for, as with n alone
