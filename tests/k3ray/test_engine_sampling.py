"""SamplingParams validation and the sampler's filters, draws and log-probabilities."""

import math

import pytest
import torch

from k3ray.engine.sample.sampler import draw, logprob_entries, sample, sampling_probs
from k3ray.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": -3}, "max_tokens must be >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"top_k": -2}, "top_k must be >= -1"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
        ({"n": 0}, "n must be >= 1"),
        ({"logprobs": 21}, "logprobs must be at most 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"max_tokens": True}, "max_tokens must be an int"),
    ],
)
def test_bad_values_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_validate_checks_vocabulary_and_context():
    SamplingParams(stop_token_ids=[3], max_tokens=9).validate(vocab_size=8 + 2, max_model_len=10)
    with pytest.raises(ValueError, match=r"stop_token_ids \[12\] are outside the vocabulary \[0, 10\)"):
        SamplingParams(stop_token_ids=[12]).validate(vocab_size=10, max_model_len=100)
    with pytest.raises(ValueError, match="max_tokens=10 can never be reached"):
        SamplingParams(max_tokens=10).validate(vocab_size=10, max_model_len=10)


def test_stop_accepts_a_string_or_a_list_and_is_frozen():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5


def test_filters_keep_the_documented_sets():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    assert sampling_probs(logits, SamplingParams(temperature=0)).tolist() == [1, 0, 0, 0, 0]
    top_k = sampling_probs(logits, SamplingParams(top_k=2))
    assert (top_k > 0).tolist() == [True, True, False, False, False]
    # top_p 0.7: 0.5 + 0.25 reaches it, so two tokens survive; 0.8 needs a third
    assert (sampling_probs(logits, SamplingParams(top_p=0.7)) > 0).sum() == 2
    assert (sampling_probs(logits, SamplingParams(top_p=0.8)) > 0).sum() == 3
    # min_p 0.2 keeps p >= 0.1
    assert (sampling_probs(logits, SamplingParams(min_p=0.2)) > 0).tolist() == [True, True, True, False, False]
    # min_p before top_p (vLLM's order): min_p 0.25 leaves 0.5 / 0.25 / 0.15, renormalised 0.56 / 0.28 /
    # 0.17, and top_p 0.8 then keeps two; top_p first would keep three (0.5 + 0.25 < 0.8) and min_p all three
    assert (sampling_probs(logits, SamplingParams(min_p=0.25, top_p=0.8)) > 0).tolist() == [True, True, False, False, False]
    probs = sampling_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    assert math.isclose(float(sampling_probs(logits, SamplingParams(temperature=0.5, top_k=3)).sum()), 1.0, rel_tol=1e-6)


def test_draw_follows_the_distribution_and_never_picks_zero_probability():
    probs = torch.tensor([0.0, 0.6, 0.0, 0.3, 0.1])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(4000)]), minlength=5).float()
    assert counts[0] == 0 and counts[2] == 0
    freq = counts / counts.sum()
    sigma = (probs * (1 - probs) / 4000).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), freq  # 5 sigma: a false alarm is ~1e-6


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0), SamplingParams(temperature=0.8)]

    def gens():
        return [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(123)]

    together = [sample(logits, params, gens()) for _ in range(2)]
    alone = sample(logits[:1], params[:1], gens()[:1])
    assert together[0] == together[1]
    assert together[0][0] == alone[0]
    assert together[0][1] == int(logits[1].argmax())


def test_logprob_entries_are_the_fp32_log_softmax_with_ranks():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    logp = torch.log_softmax(logits, -1)
    chosen = [int(logits[0].argsort()[-5]), int(logits[1].argmax())]
    entries = logprob_entries(logits, chosen, num_top=3)
    for row, entry, tok in zip(logp, entries, chosen):
        top = row.topk(3)
        assert set(entry) == set(top.indices.tolist()) | {tok}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[t]), abs=1e-6)  # same fp32 op, rounding only
            assert lp.rank == int((row > row[t]).sum()) + 1
    assert entries[0][chosen[0]].rank == 5
