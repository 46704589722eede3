"""The key-readability probe: it finds a key code planted at both sites (even in two different codes,
which a cosine cannot match), finds none in noise, and reads every token mixer of the real model."""

import json
import random

import pytest
import torch

from k3ray.tokenizer import ByteTokenizer
from k3ray_training import model as fixture_model
from k3ray_training.data import CHAIN_TASK, make_example
from k3ray_training.model import niah_config, train_logits, trainable_model
from k3ray_training.probe import Lookups, item_lookups, main, probe, readability, source_names


def _planted(items: int, codes: bool, rotate: bool, seed: int = 0) -> tuple[Lookups, torch.Tensor]:
    """items x 4 questions of 4 numbers each, D = 24: each key a random code, the numbers carrying it,
    the questions carrying it (or a fixed rotation of it), under noise of the code's own size."""
    g = torch.Generator().manual_seed(seed)
    D, N = 24, 4
    rotation = torch.linalg.qr(torch.randn(D, D, generator=g))[0] if rotate else torch.eye(D)
    questions, numbers, answers, owners = [], [], [], []
    for item in range(items):
        keys = torch.randn(N, D, generator=g) * float(codes)  # [N, D]
        stored = keys + 0.5 * torch.randn(N, D, generator=g) + 3.0  # a common offset the cosine must drop
        for asked in range(N):
            questions.append(keys[asked] @ rotation + 0.5 * torch.randn(D, generator=g))
            numbers.append(stored)
            answers.append(asked)
            owners.append(item)
    lookups = Lookups(torch.stack(questions), torch.stack(numbers), torch.ones(len(answers), N, dtype=torch.bool),
                      torch.tensor(answers))
    return lookups, torch.tensor(owners)


def test_a_key_planted_at_both_sites_is_picked_by_cosine_and_by_the_fitted_form():
    report = readability(*_planted(60, codes=True, rotate=False), rank=24, steps=600)
    assert report["chance"] == pytest.approx(0.25)
    assert report["cosine"] >= 0.95 and report["bilinear"] >= 0.85  # 0.93 measured: a fit on 30 items
    assert report["lookups"] == 120  # the second half's items only


def test_two_codes_of_one_key_are_picked_only_by_the_fitted_form():
    report = readability(*_planted(60, codes=True, rotate=True), rank=24, steps=600)
    assert report["cosine"] < 0.5  # a rotated code does not line up
    assert report["bilinear"] >= 0.8  # a head's q.k can learn the map between the codes


def test_noise_is_picked_at_chance_even_when_the_fit_memorises_it():
    report = readability(*_planted(60, codes=False, rotate=False), rank=24, steps=600)
    assert report["bilinear_fit"] > 0.5  # the fit half is learnt by heart
    assert report["cosine"] < 0.45 and report["bilinear"] < 0.45  # chance 0.25, 120 held-out lookups


def test_lookups_are_each_question_against_its_items_needles():
    tokenizer = ByteTokenizer(niah_config().vocab_size)
    digits = set(tokenizer.encode("0123456789"))
    example = make_example(CHAIN_TASK, 300, random.Random(3), tokenizer)
    lookups = item_lookups(example, digits)
    text = bytes(example.prompt + example.answer[:-1]).decode()
    assert len(lookups) == len(lookups[0][1]) >= 2  # every needle asked once
    for row, numbers, asked in lookups:
        assert all(text[n].isdigit() and not text[n - 1].isdigit() for n in numbers)  # first digits
        assert text[row] == " " and text[row + 1 : row + 8] == text[numbers[asked] : numbers[asked] + 7]


def test_the_probe_reads_every_token_mixer_without_changing_the_forward():
    config = niah_config()
    tokenizer = ByteTokenizer(config.vocab_size)
    model = trainable_model(config, seed=0).eval()
    rng = random.Random(5)
    examples = [make_example(CHAIN_TASK, 120, rng, tokenizer) for _ in range(4)]
    ids = torch.tensor([examples[0].prompt])
    trace: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        torch.testing.assert_close(train_logits(model, ids, torch.arange(ids.shape[1]), trace=trace),
                                   train_logits(model, ids, torch.arange(ids.shape[1])), rtol=0, atol=0)
    weights = trace.pop("output.weights")  # [1, T, S]
    assert all(t.shape == (1, ids.shape[1], config.hidden_size) for t in trace.values())
    assert weights.shape == (1, ids.shape[1], len(source_names(model))) == (1, ids.shape[1], 4)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, ids.shape[1]))
    report, answer_sources = probe(model, examples, set(tokenizer.encode("0123456789")), rank=4, steps=5)
    assert answer_sources == pytest.approx([0.25] * 4)  # trainable_model starts AttnRes uniform
    kinds = ["kda" if i in config.kda_layer_ids else "mla" for i in range(len(config.layer_types))]
    assert list(report) == [f"{i}.{kind}.{end}" for i, kind in enumerate(kinds) for end in ("in", "out")]
    assert all(0.0 <= r["cosine"] <= 1.0 and r["chance"] <= 0.5 for r in report.values())
    with pytest.raises(ValueError, match="at least two items"):
        probe(model, examples[:1], set(tokenizer.encode("0123456789")))


def test_the_traced_output_weights_are_those_the_logits_are_made_with(monkeypatch):
    """The output AttnRes aggregate, recorded from the forward, is the traced weights times its sources."""
    config = niah_config()
    model = trainable_model(config, seed=0).eval()
    with torch.no_grad():
        model.model.output_attn_res_proj.weight.normal_(std=0.3, generator=torch.Generator().manual_seed(0))
    calls = []
    real = fixture_model.naive_attn_res_rmsnorm

    def recording(sources, proj_weight, *args):
        out = real(sources, proj_weight, *args)
        calls.append((proj_weight, sources, out[0]))
        return out

    monkeypatch.setattr(fixture_model, "naive_attn_res_rmsnorm", recording)
    ids = torch.tensor([ByteTokenizer(config.vocab_size).encode("One of the special magic numbers for x is: 12.")])
    trace: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        train_logits(model, ids, torch.arange(ids.shape[1]), trace=trace)
    (sources, aggregate), = [(s, h) for w, s, h in calls if w is model.model.output_attn_res_proj.weight]
    weights = trace["output.weights"][0]  # [T, S]
    assert weights.max() > 0.5  # not the uniform start
    torch.testing.assert_close((weights[:, None, :] @ sources).squeeze(1), aggregate, rtol=1e-5, atol=1e-4)


def test_the_command_reports_each_site_of_a_shipped_model(tmp_path, capsys):
    out = tmp_path / "probe.json"
    main(["--model", "k3-tiny-niah", "--items", "3", "--haystack", "100", "--rank", "4", "--steps", "3",
          "--threads", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["args"]["model"] == "k3-tiny-niah" and "3.mla.in" in report["sites"]
    assert list(report["answer_sources"]) == ["embedding", "layers 0-2", "layers 3-5", "layers 6-8"]
    assert sum(report["answer_sources"].values()) == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "3.mla.in" in printed and "output AttnRes weight at the answer rows: embedding" in printed
    with pytest.raises(SystemExit):
        main(["--items", "1"])
