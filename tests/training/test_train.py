"""The k3-tiny-niah training script: a backward-capable forward equal to the serving forward, a few
steps that lower the loss, an exact resume, data in the eval prompts' formats, and an export that
k3ray loads by path."""

import dataclasses
import json
import math
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from k3ray.api import K3
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.tasks import TASKS, Cell
from k3ray.kernels.kda import l2norm
from k3ray.kernels.kda.naive import naive_chunk_kda
from k3ray.models.kda import KimiDeltaAttention
from k3ray.tokenizer import ByteTokenizer
from k3ray_training import data
from k3ray_training import model as fixture_model
from k3ray_training.init_weights import initial_weights
from k3ray_training.kda_train import chunk_kda_train
from k3ray_training.model import CopySupervision, KdaCarry, niah_config, train_logits, trainable_model
from k3ray_training.state_bank import StateBank, haystack_ids, initial_states, kda_layers
from k3ray_training.train import (
    CONFIGS,
    LOG_FILE,
    STATE_FILE,
    accumulate_step,
    apply_gains,
    batch_tensors,
    copy_targets,
    gather_targets,
    lead_digit_rows,
    length_groups,
    logged_args,
    main,
    parse_args,
    prompt_targets,
    step_examples,
    train,
)

TINY_RUN = ["--config", "tiny", "--tokens-per-step", "1024", "--max-haystack", "96", "--lr", "1e-2",
            "--warmup", "1", "--eval-every", "4", "--heldout-per-cell", "1", "--threads", "1"]


def _log(out):
    return [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]


def _losses(out):
    return [r["loss"] for r in _log(out) if "loss" in r]


def test_training_kda_matches_the_reference_chunked_form():
    gen = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 83, 2, 16
    q, k = (l2norm(torch.randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.rand(B, T, H, K, generator=gen)  # down to K3's gate bound
    beta = torch.rand(B, T, H, generator=gen)
    want, _ = naive_chunk_kda(q, k, v, g, beta, K**-0.5)
    torch.testing.assert_close(chunk_kda_train(q, k, v, g, beta, K**-0.5), want, atol=1e-5, rtol=1e-4)


def test_training_kda_carries_a_state_and_padding_leaves_it_alone():
    gen = torch.Generator().manual_seed(1)
    B, T, H, K = 2, 83, 2, 16
    q, k = (l2norm(torch.randn(B, T, H, K, generator=gen)) for _ in range(2))
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5 * torch.rand(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, K, generator=gen)
    want_o, want_s = naive_chunk_kda(q, k, v, g, beta, K**-0.5, state, output_final_state=True)
    o, s = chunk_kda_train(q, k, v, g, beta, K**-0.5, state, output_final_state=True)
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, want_s, atol=1e-4, rtol=1e-4)
    # row 1 ends at 50: zero beta and gate on its padding keep its final state the one after token 49
    g[1, 50:], beta[1, 50:] = 0.0, 0.0
    _, padded = chunk_kda_train(q, k, v, g, beta, K**-0.5, state, output_final_state=True)
    _, short = naive_chunk_kda(q[1:, :50], k[1:, :50], v[1:, :50], g[1:, :50], beta[1:, :50], K**-0.5, state[1:],
                               output_final_state=True)
    torch.testing.assert_close(padded[1:], short, atol=1e-4, rtol=1e-4)


def test_training_forward_matches_the_serving_forward():
    config = CONFIGS["tiny"]()
    model = trainable_model(config, seed=3)
    with torch.no_grad():  # non-trivial AttnRes queries, so depth mixing is exercised
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(0, 0.3)
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(1))
    k3 = K3(model.eval(), ByteTokenizer(config.vocab_size))
    want = torch.stack([k3.logits(row.tolist()) for row in ids]).reshape(300, -1)
    with torch.no_grad():
        got = train_logits(model, ids, torch.arange(300))
    torch.testing.assert_close(got, want.float(), atol=2e-3, rtol=2e-3)


def test_items_use_the_eval_templates_and_the_readers_answer():
    tok = ByteTokenizer()
    rng = random.Random(0)
    for name in ("niah", "niah_multikey_1", "vt"):
        ex = data.make_example(name, 300, rng, tok)
        text = tok.decode(ex.prompt)
        # the eval's own item for the same task in a bare name's wording ends with the same question template
        task = dataclasses.replace(TASKS[name], template=data.BASE_WORDING)
        item = task.build(Cell(name, len(ex.prompt), 50.0), OracleTarget(), seed=0)
        assert text.split("?")[-1].split(" ")[:4] == item.prompt.split("?")[-1].split(" ")[:4]
        assert ex.answer[-1] == tok.eos_token_id
        answer = tok.decode(ex.answer[:-1])
        assert answer.startswith(" ") and all(ref in answer for ref in ex.references)


@pytest.mark.parametrize("task, sizes, sep", [(data.RECALL_TASK, (2, 8), ":"), (data.RECALL_WIDE_TASK, (8, 16), ":"),
                                             (data.RECALL_IS_TASK, (6, 14), " is:"), ("recall_letter", (2, 10), ":"),
                                             ("recall_short", (4, 12), ":")])
def test_recall_items_ask_every_key_and_label_the_earlier_answers(task, sizes, sep):
    tok, rng = ByteTokenizer(), random.Random(0)
    asked_forms = set()
    for _ in range(20):
        ex = data.make_example(task, 0, rng, tok)
        assert ex.task == task
        pairs, queries = tok.decode(ex.prompt).split(" | ")
        table = dict(pair.split(f"{sep} ") for pair in pairs.rstrip(".").split(". "))
        assert all(" " not in k and v.isdigit() and len(v) == 7 for k, v in table.items())
        if task in data.LETTER_KEY_TASKS:  # the curriculum's short keys, each of the rung's length
            low, high = data.LETTER_KEY_TASKS[task]
            assert all(k.isalpha() and k.islower() and low <= len(k) <= high for k in table)
        ask = next(a for a in (sep, data.RECALL_LONG_QUERY) if queries.endswith(a))
        asked_forms.add(ask)
        *answered, asked = queries.split(". ")
        answered = [q.split(f"{ask} ") for q in answered]
        asked = asked.removesuffix(ask)
        assert sizes[0] <= len(table) <= sizes[1]
        assert sorted([k for k, _ in answered] + [asked]) == sorted(table)
        assert all(table[k] == v for k, v in answered)
        assert tok.decode(ex.answer[:-1]) == " " + table[asked] and ex.references == (table[asked],)
        # the labelled prompt positions are exactly those predicting the earlier answers' digits
        assert "".join(tok.decode([ex.prompt[p + 1]]) for p in ex.prompt_labels) == "".join(v for _, v in answered)
    assert len(asked_forms) == 2  # both query forms occur


@pytest.mark.parametrize("task, sizes", [(data.CHAIN_TASK, (4, 4)), (data.NEEDLES_WIDE_TASK, (6, 12))])
def test_needle_items_ask_each_key_in_the_eval_question_and_label_the_earlier_answers(task, sizes):
    tok, rng = ByteTokenizer(), random.Random(0)
    question_form = re.compile(r"\nWhat are all the special magic numbers for (\S+) mentioned in the text above\?"
                               r" The special magic numbers for \1 mentioned in the text above are")
    for _ in range(10):
        ex = data.make_example(task, 600, rng, tok)
        assert ex.task == task
        text = tok.decode(ex.prompt)
        body = text[: text.index("\nWhat are all")]
        table = dict(re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", body))
        asked = question_form.findall(text)
        assert sizes[0] <= len(table) <= sizes[1] and sorted(asked) == sorted(table)  # each needle asked once
        answered = re.findall(r"mentioned in the text above are (\d+)\.", text)
        assert answered == [table[k] for k in asked[:-1]]
        assert "".join(tok.decode([ex.prompt[p + 1]]) for p in ex.prompt_labels) == "".join(" " + v for v in answered)
        assert tok.decode(ex.answer) == f" {table[asked[-1]]}[EOS]" and ex.references == (table[asked[-1]],)
        # with its answered questions removed, the item is the eval's prompt for the last key
        assert data.answer_text(body + text[text.rindex("\nWhat are all"):]) == table[asked[-1]]


def test_lead_digit_rows_are_each_answer_numbers_first_digit():
    tok, rng = ByteTokenizer(), random.Random(0)
    items = [data.make_example(data.NEEDLES_WIDE_TASK, 0, rng, tok), data.make_example("niah", 300, rng, tok)]
    batch = batch_tensors(items, pad_id=511)
    lead = lead_digit_rows(batch, torch.tensor(tok.encode("0123456789")))
    answered = tok.decode(items[0].prompt).count(" mentioned in the text above are ")  # labelled earlier answers
    assert lead.sum().item() == 1 + answered + 1  # needles_wide's answer and earlier answers, niah's answer
    assert all(chr(c) in "0123456789" for c in batch.labels[lead].tolist())
    assert [t for t, x in zip(batch.tasks, lead.tolist()) if x].count("niah") == 1


def test_length_groups_keep_every_item_once_and_bound_the_padding():
    tok, rng = ByteTokenizer(), random.Random(0)
    items = [data.make_example(task, 0, rng, tok) for task in ["copy"] * 3 + ["recall"] * 4 + ["needles_wide"] * 2]
    groups = length_groups(items, slack=1.25)
    assert sorted(map(id, items)) == sorted(id(e) for g in groups for e in g)
    size = [[len(e.prompt) + len(e.answer) for e in g] for g in groups]
    assert all(len(g) * max(g) <= 1.25 * sum(g) for g in size)
    assert 2 < len(groups) < len(items)  # copy, recall and needles_wide apart; like lengths together
    assert len(length_groups(items, slack=float("inf"))) == 1


def _whole_batch_copy_supervision(items, width, digits, gather=False):
    flat = [(b * width + row, b * width + src) for b, e in enumerate(items) for row, src in copy_targets(e, digits)]
    copy = CopySupervision(*torch.tensor(flat).T)
    if gather:
        flat = [(b * width + row, b * width + start, b * width + end) for b, e in enumerate(items)
                for row, start, end in gather_targets(e, copy_targets(e, digits, first=1))]
        copy.gather_rows, copy.gather_starts, copy.gather_ends = torch.tensor(flat).T
    return copy


@pytest.mark.parametrize("lm_weight, copy_weight, gather_weight, route_weight",
                         [(0.0, 0.0, 0.0, 0.0), (0.2, 0.0, 0.0, 0.0), (0.2, 0.1, 0.0, 0.0), (0.0, 0.1, 0.3, 0.0),
                          (0.0, 0.1, 0.3, 0.5)])
def test_micro_batched_step_has_the_whole_batch_gradient(lm_weight, copy_weight, gather_weight, route_weight):
    """The length groups' accumulated gradient == the gradient of the one padded batch it replaces:
    mean answer-row loss + lm_weight * mean prompt next-token loss + copy_weight * mean copy-attention loss
    + gather_weight * mean key-gather attention loss + route_weight * mean AttnRes route loss."""
    tok, rng = ByteTokenizer(), random.Random(1)
    items = [data.make_example(task, 60, rng, tok) for task in ("copy", "recall", "niah", "copy", "needles_wide")]
    model = trainable_model(CONFIGS["tiny"](), seed=0)
    digits = torch.tensor(tok.encode("0123456789"))

    batch = batch_tensors(items, tok.pad_token_id)
    lm_rows, lm_labels = prompt_targets(items, batch.ids.shape[1])
    copy = _whole_batch_copy_supervision(items, batch.ids.shape[1], set(digits.tolist()), gather=gather_weight > 0)
    copy.route = route_weight > 0
    logits = train_logits(model, batch.ids, torch.cat([batch.rows, lm_rows]), copy=copy)
    R = len(batch.rows)
    whole = F.cross_entropy(logits[:R], batch.labels) + lm_weight * F.cross_entropy(logits[R:], lm_labels)
    whole = whole + copy_weight * torch.stack(copy.losses).mean() / len(copy.rows)
    if gather_weight:
        whole = whole + gather_weight * copy.gather_losses[0] / len(copy.gather_rows)
    if route_weight:
        whole = whole + route_weight * sum(copy.route_losses) / len(copy.gather_rows)
    want = torch.autograd.grad(whole, list(model.parameters()), allow_unused=True)

    model.zero_grad(set_to_none=True)
    step = accumulate_step(model, items, tok.pad_token_id, lm_weight, digits, copy_weight=copy_weight,
                           gather_weight=gather_weight, route_weight=route_weight)
    if copy_weight:
        assert step.copy_loss == pytest.approx(torch.stack(copy.losses).mean().item() / len(copy.rows), rel=1e-4)
    if gather_weight:
        assert step.gather_loss == pytest.approx(copy.gather_losses[0].item() / len(copy.gather_rows), rel=1e-4)
    if route_weight:
        assert len(copy.route_losses) == 2  # the matching layer's input and the output
        assert step.route_loss == pytest.approx(sum(copy.route_losses).item() / len(copy.gather_rows), rel=1e-4)
    assert len(step.shapes) >= 3
    assert step.loss == pytest.approx(F.cross_entropy(logits[:R], batch.labels).item(), rel=1e-5)
    assert sorted(step.tasks) == sorted(batch.tasks) and step.lead.sum() == lead_digit_rows(batch, digits).sum()
    for (name, p), g in zip(model.named_parameters(), want):
        if g is None:
            assert p.grad is None or not p.grad.any(), name
        else:  # fp32 sums in another order (KDA chunks over other padded widths): measured <= 8e-6 of scale
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=5e-5 * g.abs().max().item() + 1e-9, msg=name)


def test_copy_targets_point_each_number_digit_at_its_first_occurrence():
    tok, rng = ByteTokenizer(), random.Random(2)
    digits = set(tok.encode("0123456789"))
    for task in ("copy", "recall_is", "needles_wide", "niah_multikey_1", "niah"):
        ex = data.make_example(task, 300, rng, tok)
        seq, pairs = ex.prompt + ex.answer, copy_targets(ex, digits)
        text = tok.decode(ex.prompt)
        asked = ex.references[0]
        # every digit of the answer is a row, aimed at the same digit of the answer's first occurrence
        start = len(text[: text.index(asked)].encode())
        first = len(ex.prompt) - 1 + tok.decode(ex.answer).index(asked)  # the row writing the first digit
        answer_rows = [(r, s) for r, s in pairs if r >= len(ex.prompt) - 1]
        assert answer_rows == [(first + j, start + j) for j in range(len(asked))], task
        assert all(s < r and seq[s] == seq[r + 1] for r, s in pairs), task
        lead = copy_targets(ex, digits, first=1)  # the first digit of each copied number only
        assert set(lead) < set(pairs) and (first, start) in lead, task
        assert all((r - 1, s - 1) not in pairs for r, s in lead), task
    for task in ("recall_wide", "needles_wide"):  # and every digit of the labelled earlier answers
        ex = data.make_example(task, 0, rng, tok)
        labelled_digits = sum(chr(ex.prompt[p + 1]).isdigit() for p in ex.prompt_labels)
        assert len(copy_targets(ex, digits)) == labelled_digits + 7 > 7
        numbers = sum(chr(ex.prompt[p + 1]).isdigit() and not chr(ex.prompt[p]).isdigit() for p in ex.prompt_labels)
        assert len(copy_targets(ex, digits, first=1)) == numbers + 1, task


def forward_recording_attention(monkeypatch, model, batch, copy) -> list[tuple[torch.Tensor, ...]]:
    """train_logits with SDPA replaced by an explicit softmax: each MLA layer's attention weights
    [B, H, T, T], its (zero-padded) values [B, H, T, d], queries, keys and scale, as the forward uses them."""
    T = batch.ids.shape[1]
    seen = []

    def explicit_sdpa(q, k, v, is_causal, scale):
        w = (q @ k.transpose(-1, -2) * scale).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        seen.append((w.softmax(-1), v, q, k, scale))
        return seen[-1][0] @ v

    monkeypatch.setattr(fixture_model.F, "scaled_dot_product_attention", explicit_sdpa)
    with torch.no_grad():
        train_logits(model, batch.ids, batch.rows, copy=copy)
    return seen


def test_copy_attention_loss_is_head_zeros_causal_attention_on_the_source(monkeypatch):
    """Checked against the attention weights the forward itself uses (SDPA replaced by an explicit
    softmax that records them): -log of head 0's weight on each source, summed, per MLA layer."""
    tok, rng = ByteTokenizer(), random.Random(3)
    items = [data.make_example("recall", 0, rng, tok), data.make_example("copy", 0, rng, tok)]
    model = trainable_model(CONFIGS["tiny"](), seed=0).eval()
    batch = batch_tensors(items, tok.pad_token_id)
    T = batch.ids.shape[1]
    copy = _whole_batch_copy_supervision(items, T, set(tok.encode("0123456789")))
    seen = [w for w, *_ in forward_recording_attention(monkeypatch, model, batch, copy)]
    b, t, s = copy.rows // T, copy.rows % T, copy.targets % T
    want = [-w[b, 0, t, s].log().sum() for w in seen]
    assert len(want) == len(copy.losses) == sum(1 for lt in model.config.layer_types if lt != "kda") > 0
    torch.testing.assert_close(torch.stack(copy.losses), torch.stack(want), rtol=1e-5, atol=1e-4)


def test_gather_targets_span_the_copied_numbers_key_at_the_number_and_at_the_question():
    tok, rng = ByteTokenizer(), random.Random(4)
    digits = set(tok.encode("0123456789"))
    for task in ("niah_multikey_1", "recall", "recall_is", "recall_letter", "multikey_chain"):
        ex = data.make_example(task, 300, rng, tok)
        text = tok.decode(ex.prompt + ex.answer)
        pairs = copy_targets(ex, digits, first=1)
        spans = gather_targets(ex, pairs)
        assert len(spans) == 2 * len(pairs) > 0, task
        for (row, source), stored, asked in zip(pairs, spans[::2], spans[1::2]):
            key = text[stored[1] : stored[2]]
            number = re.match(r"\d+", text[source:]).group()
            assert stored[0] == source and re.search(rf"(^|[ \n]){re.escape(key)}( is)?: {number}", text), task
            assert asked[0] == row and text[asked[1] : asked[2]] == key and source < asked[1] < row, task
            assert key not in text[asked[2] : row + 1], task  # the question's key is its last mention
    assert gather_targets(data.make_example("copy", 0, rng, tok), [(30, 2)]) == []  # a copied number has no key


def test_a_later_lookup_digit_gathers_its_numbers_key_at_both_ends():
    """--lookup-digits 2: each copied number's second digit is looked up too, with the key before the number
    (not before the digit) at the number's side and the question's key at the row that writes it."""
    tok, rng = ByteTokenizer(), random.Random(5)
    digits = set(tok.encode("0123456789"))
    for task in ("niah_multikey_1", "recall_is", "multikey_chain"):
        ex = data.make_example(task, 300, rng, tok)
        lead = gather_targets(ex, copy_targets(ex, digits, first=1))
        pairs = copy_targets(ex, digits, first=2)
        spans = gather_targets(ex, pairs)
        assert len(spans) == 2 * len(pairs) == 2 * len(lead), task  # lead: 2 spans a number; here 2 digits a number
        by_row = {row: (source, s, e) for (row, source), (_, s, e) in zip(pairs, spans[::2])}
        for row, source in pairs[::2]:  # a lead digit, then the next digit of the same number one row on
            assert by_row[row + 1][0] == source + 1 and by_row[row + 1][1:] == by_row[row][1:], task
        asked = {row: (s, e) for row, s, e in spans[1::2]}
        assert all(asked[row + 1] == asked[row] for row, _ in pairs[::2]), task
    assert copy_targets(ex, digits, first=None) == copy_targets(ex, digits)


def _gather_case(seed: int, *tasks: tuple[str, int]):
    """-> the tiny model, a batch of items of (task, haystack), its copy supervision with gather spans."""
    tok, rng = ByteTokenizer(), random.Random(seed)
    items = [data.make_example(task, haystack, rng, tok) for task, haystack in tasks]
    batch = batch_tensors(items, tok.pad_token_id)
    copy = _whole_batch_copy_supervision(items, batch.ids.shape[1], set(tok.encode("0123456789")), gather=True)
    return trainable_model(CONFIGS["tiny"](), seed=0).eval(), batch, copy


@pytest.mark.parametrize("gather_layer", [1, 2])
def test_gather_loss_is_one_mla_layers_head_one_divergence_from_reading_the_key_evenly(monkeypatch, gather_layer):
    """KL(uniform on each key span || head 1's attention weights), in the gathering MLA layer only (the
    copy rows then supervise the other MLA layers), against the weights the forward itself uses."""
    model, batch, copy = _gather_case(5, ("recall", 0), ("recall_is", 0))
    copy.gather_layer = gather_layer
    T = batch.ids.shape[1]
    seen = [w for w, *_ in forward_recording_attention(monkeypatch, model, batch, copy)]
    gathering = seen[gather_layer - 1][:, fixture_model.GATHER_HEAD]  # [B, T, T]
    spans = zip(copy.gather_rows.tolist(), copy.gather_starts.tolist(), copy.gather_ends.tolist())
    want = sum(-gathering[r // T, r % T, s % T : e % T].log().mean() - math.log(e - s) for r, s, e in spans)
    assert len(copy.gather_losses) == 1 and len(copy.losses) == len(seen) - 1 > 0
    torch.testing.assert_close(copy.gather_losses[0], want, rtol=1e-5, atol=1e-4)
    copying = seen[: gather_layer - 1] + seen[gather_layer:]
    b, t, s = copy.rows // T, copy.rows % T, copy.targets % T
    torch.testing.assert_close(torch.stack(copy.losses), torch.stack([-w[b, 0, t, s].log().sum() for w in copying]),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gather_layer", [1, 2])
def test_fingerprint_contrast_and_match_are_each_questions_softmax_over_the_gathered_numbers(monkeypatch, gather_layer):
    """-log of the summed softmax over the numbers of the question's own key: of cosines / temperature
    between head 1's outputs of the gathering MLA layer (the fingerprint contrast), and of the next MLA
    layer's head-0 attention scores (the match)."""
    model, batch, copy = _gather_case(6, ("recall", 0), ("niah_multivalue", 200))
    copy.gather_layer = gather_layer
    T = batch.ids.shape[1]
    keys = [tuple(batch.ids.flatten()[s:e].tolist()) for s, e in zip(copy.gather_starts[0::2], copy.gather_ends[0::2])]
    copy.gather_key_ids, copy.contrast, copy.match = torch.tensor([keys.index(key) for key in keys]), True, True
    assert len(set(keys)) < len(keys)  # niah_multivalue's numbers share their key: several right answers
    seen = forward_recording_attention(monkeypatch, model, batch, copy)
    (w, v, *_), (_, _, q, k, scale) = seen[gather_layer - 1], seen[gather_layer]
    head = fixture_model.GATHER_HEAD
    out = torch.stack([w[r // T, head, r % T] @ v[r // T, head, :, : model.config.v_head_dim] for r in copy.gather_rows])
    out = F.normalize(out, dim=-1)
    p_own = ((out[1::2] @ out[0::2].T) / fixture_model.CONTRAST_TEMPERATURE).softmax(-1)
    same = copy.gather_key_ids[:, None] == copy.gather_key_ids[None, :]
    torch.testing.assert_close(copy.contrast_losses[0], -(p_own * same).sum(-1).log().sum(), rtol=1e-5, atol=1e-4)
    # hop 2: the next MLA layer's head-0 attention scores of each question on every gathered number
    rows = copy.gather_rows
    scores = q[rows[1::2] // T, 0, rows[1::2] % T] @ k[rows[0::2] // T, 0, rows[0::2] % T].T * scale
    torch.testing.assert_close(copy.match_losses[0], -(scores.softmax(-1) * same).sum(-1).log().sum(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("gather_layer", [1, 2])
def test_self_read_loss_is_the_gathering_layers_self_head_weight_on_each_numbers_own_row(monkeypatch, gather_layer):
    """-log of SELF_HEAD's attention weight, at each number's first digit (the even gather rows), on that row
    itself, summed, in the gathering MLA layer, against the weights the forward itself uses."""
    _, batch, copy = _gather_case(5, ("recall", 0), ("recall_is", 0))
    model = trainable_model(niah_config(), seed=0).eval()  # the tiny config's MLA has no head 2
    copy.gather_layer, copy.self_read = gather_layer, True
    T = batch.ids.shape[1]
    weights = forward_recording_attention(monkeypatch, model, batch, copy)[gather_layer - 1][0]  # [B, H, T, T]
    numbers = copy.gather_rows[0::2]
    b, t = numbers // T, numbers % T
    assert len(copy.self_losses) == 1 and len(numbers) > 1
    torch.testing.assert_close(copy.self_losses[0], -weights[b, fixture_model.SELF_HEAD, t, t].log().sum(),
                               rtol=1e-5, atol=1e-4)


def _band_losses(w: torch.Tensor) -> torch.Tensor:
    low, high = fixture_model.ROUTE_BAND
    assert (w < low).any() and ((w > low) & (w < high)).any() and (w > high).any()  # each side of the band
    return (math.log(low) - w.log()).clamp(min=0) + (math.log(1 - high) - (1 - w).log()).clamp(min=0)


@pytest.mark.parametrize("gather_layer", [1, 2])
def test_route_losses_keep_attn_res_weights_on_the_gathered_key_and_the_match_in_their_band(monkeypatch,
                                                                                            gather_layer):
    """max(0, log 0.5 - log w) + max(0, log 0.1 - log(1 - w)), summed: w the weight that the next MLA layer's
    mixer AttnRes gives, at each gather row, to the source holding the gathering layer's output (bank[block + 1]:
    bank[0] is the embedding; or the open block's partial sum), and the weight the output AttnRes gives, at
    each question, to the source holding the matching layer's output; each recovered from the aggregate the
    forward itself computes."""
    model, batch, copy = _gather_case(5, ("recall", 0), ("recall_is", 0))
    copy.gather_layer, copy.route = gather_layer, True
    mla = [layer for layer in model.model.layers.values() if not isinstance(layer.self_attn, KimiDeltaAttention)]
    gathering, matching = mla[gather_layer - 1], mla[gather_layer]
    output_proj = model.model.output_attn_res_proj.weight
    with torch.no_grad():  # trainable_model starts AttnRes uniform (any source reads the same); logits of std ~3
        for i, proj in enumerate((matching.self_attention_res_proj.weight, output_proj)):
            proj.normal_(std=0.4, generator=torch.Generator().manual_seed(2 + i))
    calls = []

    def recording(sources, proj_weight, *args):
        out = real(sources, proj_weight, *args)
        calls.append((proj_weight, sources, out[0]))
        return out

    def weights_at(proj, rows=slice(None)):
        """the AttnRes weights [R, S] that make the recorded aggregate from the recorded sources ([S, D] has rank S)"""
        (sources, aggregate), = [(s[rows], h[rows]) for w, s, h in calls if w is proj]
        weights = torch.linalg.lstsq(sources.transpose(1, 2), aggregate.unsqueeze(-1)).solution.squeeze(-1)
        torch.testing.assert_close(weights.sum(-1), torch.ones(len(weights)), rtol=0, atol=1e-4)
        return weights

    real = fixture_model.naive_attn_res_rmsnorm
    monkeypatch.setattr(fixture_model, "naive_attn_res_rmsnorm", recording)
    questions = copy.gather_rows[1::2]
    with torch.no_grad():
        train_logits(model, batch.ids, questions, copy=copy)  # the output AttnRes at the questions' rows
    block = model.config.attn_res_block_size
    assert copy.gathered_source == gathering.layer_idx // block + 1
    assert copy.matched_source == matching.layer_idx // block + 1
    assert len(copy.route_losses) == 2
    w_in = weights_at(matching.self_attention_res_proj.weight, copy.gather_rows)[:, copy.gathered_source]
    torch.testing.assert_close(copy.route_losses[0], _band_losses(w_in).sum(), rtol=1e-4, atol=1e-3)
    w_out = weights_at(output_proj)[:, copy.matched_source]
    torch.testing.assert_close(copy.route_losses[1], _band_losses(w_out).sum(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("gather_layer", [1, 2])
def test_answer_readout_is_the_matching_heads_share_of_each_questions_lead_digit_logits(monkeypatch, gather_layer):
    """Head 0's term is what the matching layer's output loses when that head's o_proj columns are zeroed; the
    shares of every source's whole term add up to the forward's logits; the loss is their cross-entropy against
    the digit each answer row predicts."""
    model, batch, copy = _gather_case(5, ("recall", 0), ("recall_is", 0))
    copy.gather_layer, copy.readout = gather_layer, True
    with torch.no_grad():  # AttnRes starts uniform; any weights make the shares differ
        model.model.output_attn_res_proj.weight.normal_(std=0.4, generator=torch.Generator().manual_seed(3))
    matching = [i for i, kind in enumerate(model.config.layer_types) if kind == "mla"][gather_layer]
    answers = copy.gather_rows[1::2]
    calls = []

    def recording(sources, *args):
        out = real(sources, *args)
        calls.append(sources)
        return out

    real = fixture_model.naive_attn_res_rmsnorm
    monkeypatch.setattr(fixture_model, "naive_attn_res_rmsnorm", recording)
    trace, without = {}, {}
    with torch.no_grad():
        logits = train_logits(model, batch.ids, answers, copy=copy, trace=trace)
        attn = model.model.layers[str(matching)].self_attn
        attn.o_proj.weight[:, : attn.v_dim] = 0.0  # head 0's columns
        train_logits(model, batch.ids, answers, trace=without)
    key = f"{matching}.mla.out"
    flat = lambda t: t.reshape(-1, t.shape[-1])[answers]  # noqa: E731
    term = copy.readout_parts[0]
    torch.testing.assert_close(term, flat(trace[key]) - flat(without[key]), rtol=1e-4, atol=1e-5)
    sources = calls[: len(calls) // 2][-1]  # the first of the two forwards: its last AttnRes is the output's
    assert sources.shape[0] == len(answers) and len(answers) > 1
    shares = sum(fixture_model.readout_logits(model, sources, sources[:, s], s) for s in range(sources.shape[1]))
    torch.testing.assert_close(shares, logits, rtol=1e-4, atol=1e-4)
    labels = batch.ids.flatten()[answers + 1]  # each answer row predicts the asked number's first digit
    assert torch.equal(labels, batch.ids.flatten()[copy.gather_rows[0::2]])
    want = F.cross_entropy(fixture_model.readout_logits(model, sources, term, copy.matched_source), labels,
                           reduction="sum")
    torch.testing.assert_close(copy.readout_losses[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather_layer", [1, 2])
def test_value_readout_is_the_heads_share_were_it_to_read_only_the_asked_number(monkeypatch, gather_layer):
    """The value term at a row is what head 0 adds there when it reads one row: weighted by the head's attention
    and summed over the row's positions, the value terms are its term (so a head that reads the asked number
    passes on what this loss trains); the loss is the cross-entropy of that term's share on the number's digit."""
    model, batch, copy = _gather_case(6, ("recall", 0), ("recall_is", 0))
    copy.gather_layer, copy.readout, copy.value_readout = gather_layer, True, True
    with torch.no_grad():
        model.model.output_attn_res_proj.weight.normal_(std=0.4, generator=torch.Generator().manual_seed(3))
    captured = {}
    real_value = fixture_model._value_term

    def capturing(attn, flat, v, sources, rows, head):
        captured.update(attn=attn, flat=flat, v=v)
        return real_value(attn, flat, v, sources, rows, head)

    monkeypatch.setattr(fixture_model, "_value_term", capturing)
    real_readout, shares = fixture_model.readout_logits, []
    monkeypatch.setattr(fixture_model, "readout_logits", lambda m, src, term, s: shares.append(src) or real_readout(m, src, term, s))
    with torch.no_grad():
        train_logits(model, batch.ids, copy.gather_rows[1::2], copy=copy)
    T = batch.ids.shape[1]
    attn, flat, v = captured["attn"], captured["flat"], captured["v"]
    row = copy.gather_rows[1].item()  # the first question's answer row
    positions = torch.arange((row // T) * T, row + 1)  # its sequence up to the row
    with torch.no_grad():
        every = real_value(attn, flat, v, positions, torch.full_like(positions, row), head=0)  # [t + 1, D]
        q = attn.project_q(flat).view(*batch.ids.shape, attn.num_heads, -1).transpose(1, 2)
        k, _ = attn.expand_kv(attn.project_latent(flat))
        k = k.view(*batch.ids.shape, attn.num_heads, -1).transpose(1, 2)
        log_attention, _ = fixture_model._row_attention(q, k, attn.scale, torch.tensor([row]), head=0)
    weighted = log_attention[0, : len(positions)].exp() @ every
    torch.testing.assert_close(weighted, copy.readout_parts[0][0], rtol=1e-4, atol=1e-5)
    digits = batch.ids.flatten()[copy.gather_rows[0::2]]
    want = F.cross_entropy(real_readout(model, shares[-1], copy.value_parts[0], copy.matched_source), digits,
                           reduction="sum")
    assert len(copy.value_losses) == 1 and copy.value_parts[0].shape == copy.readout_parts[0].shape
    torch.testing.assert_close(copy.value_losses[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gather_layer", [1, 2])
def test_gather_gain_scales_only_the_gathering_heads_output_projection(gather_layer):
    model = trainable_model(CONFIGS["tiny"](), seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    fixture_model.amplify_mla_head(model, gather_layer, 4.0, head=fixture_model.GATHER_HEAD)
    mla = [i for i, kind in enumerate(model.config.layer_types) if kind == "mla"]
    name = f"model.layers.{mla[gather_layer - 1]}.self_attn.o_proj.weight"
    dv = model.config.v_head_dim
    head = slice(fixture_model.GATHER_HEAD * dv, (fixture_model.GATHER_HEAD + 1) * dv)
    after = dict(model.named_parameters())
    torch.testing.assert_close(after[name][:, head], 4.0 * before[name][:, head], rtol=0, atol=0)
    rest = torch.ones(after[name].shape[1], dtype=torch.bool)
    rest[head] = False
    assert torch.equal(after[name][:, rest], before[name][:, rest])
    assert all(torch.equal(after[n], before[n]) for n in before if n != name)


def test_match_gain_scales_head_0_of_the_layer_after_the_gathering_one():
    model = trainable_model(CONFIGS["tiny"](), seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    apply_gains(model, parse_args(["--out", "unused", "--gather-layer", "1", "--match-gain", "3"]))
    mla = [i for i, kind in enumerate(model.config.layer_types) if kind == "mla"]
    name = f"model.layers.{mla[1]}.self_attn.o_proj.weight"
    dv = model.config.v_head_dim
    after = dict(model.named_parameters())
    torch.testing.assert_close(after[name][:, :dv], 3.0 * before[name][:, :dv], rtol=0, atol=0)
    assert torch.equal(after[name][:, dv:], before[name][:, dv:])
    assert all(torch.equal(after[n], before[n]) for n in before if n != name)


def test_match_gain_after_the_last_mla_layer_is_refused(tmp_path):
    mla_layers = sum(kind == "mla" for kind in CONFIGS["tiny"]().layer_types)
    with pytest.raises(SystemExit, match="--match-gain"):
        train(parse_args(["--out", str(tmp_path), "--config", "tiny", "--gather-layer", str(mla_layers),
                          "--match-gain", "2", "--steps", "1"]))


def test_a_fixed_haystack_mix_replaces_the_curriculum():
    tok = ByteTokenizer()

    def prompt_lengths(*flags):
        args = parse_args(["--out", "unused", "--tasks", "niah=1", "--steps", "100", *flags])
        return [len(e.prompt) for step in range(4) for e in step_examples(args, step, tok)]

    short, long = prompt_lengths("--haystacks", "60=1"), prompt_lengths("--haystacks", "400=1")
    assert 300 < min(long) - max(short) and max(long) - min(short) < 400  # 340 more haystack characters
    assert max(prompt_lengths()) < min(long)  # the curriculum's first steps are short
    with pytest.raises(SystemExit, match="--haystacks sizes"):
        parse_args(["--out", "unused", "--haystacks", "big=1"])


def test_a_few_steps_lower_the_loss_and_resume_exactly(tmp_path):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    main(["--out", str(whole), "--steps", "8", *TINY_RUN])
    losses = _losses(whole)
    assert len(losses) == 8
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    assert any("heldout" in r for r in _log(whole))
    assert all(set(r["task_loss"]) <= set(data.TASK_MIX) | set(data.BOOTSTRAP_TASKS) for r in _log(whole) if "loss" in r)
    assert any(set(r.get("lead_digit_loss", ())) & set(r["task_loss"]) for r in _log(whole) if "loss" in r)
    main(["--out", str(halves), "--steps", "8", "--stop-at", "4", *TINY_RUN])
    assert len(_losses(halves)) == 4
    main(["--out", str(halves), "--steps", "8", *TINY_RUN])
    assert _losses(halves) == pytest.approx(losses, rel=1e-3)


def test_frozen_parameters_keep_their_values_and_the_rest_train(tmp_path):
    out = tmp_path / "run"
    main(["--out", str(out), "--steps", "2", "--freeze", r"model\.layers\.0\.", "--freeze", r"model\.embed",
          "--gather-attention", "0.5", "--copy-attention", "0.3", *TINY_RUN])
    start = trainable_model(CONFIGS["tiny"](), seed=0).state_dict()
    trained = torch.load(out / STATE_FILE, weights_only=True)["model"]
    frozen = [n for n in start if n.startswith(("model.layers.0.", "model.embed")) and "correction_bias" not in n]
    assert frozen and all(torch.equal(trained[n], start[n]) for n in frozen)
    assert not torch.equal(trained["model.layers.1.self_attn.q_proj.weight"], start["model.layers.1.self_attn.q_proj.weight"])
    assert _log(out)[0]["frozen"] == len(frozen) + sum("correction_bias" in n for n in start if n.startswith("model.layers.0."))
    assert all(r["gather_attention_loss"] > 0 for r in _log(out) if "loss" in r)
    with pytest.raises(SystemExit, match="matches no parameter"):
        main(["--out", str(tmp_path / "other"), "--steps", "1", "--freeze", "model.layer0", *TINY_RUN])
    with pytest.raises(SystemExit, match="MLA layers 1 to 3"):
        main(["--out", str(tmp_path / "other"), "--steps", "1", "--gather-layer", "4", *TINY_RUN])
    with pytest.raises(SystemExit, match="--self-read asks MLA head 2; the tiny config has 2"):
        main(["--out", str(tmp_path / "other"), "--steps", "1", "--self-read", "0.5", *TINY_RUN])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA (tests/gpu trains on it)")
def test_a_run_asked_for_cuda_on_a_machine_without_it_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--device: device 'cuda' asks for CUDA"):
        main(["--out", str(tmp_path / "run"), "--steps", "1", "--device", "cuda", *TINY_RUN])
    assert not (tmp_path / "run").exists()  # refused before anything is written
    with pytest.raises(SystemExit, match="--device: device must be one of"):
        main(["--out", str(tmp_path / "run"), "--steps", "1", "--device", "tpu", *TINY_RUN])


def test_export_loads_by_path_with_mxfp4_experts_and_the_log_names_no_machine_path(tmp_path):
    out = tmp_path / "runs" / "run"
    main(["--out", str(out), "--steps", "2", "--export", str(tmp_path / "ckpt"), *TINY_RUN])
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert hf["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert not (tmp_path / "ckpt" / LOG_FILE).exists()  # the log stays with the run, out of the checkpoint
    assert (_log(out)[0]["args"]["out"], _log(out)[0]["args"]["export"]) == ("run", "../ckpt")
    assert str(tmp_path) not in (out / LOG_FILE).read_text()
    k3 = K3.load(str(tmp_path / "ckpt"), device="cpu")
    assert k3.model.config.expert_format == "mxfp4"
    assert 1 <= len(k3.generate(ByteTokenizer().encode("One of the special magic numbers"), max_new_tokens=4)) <= 4


def test_logged_paths_are_relative_to_the_folder_holding_the_run():
    args = {"out": "/scratch/s21/runs/C", "init_from": "/scratch/s21/B_fork.pt", "export": None, "steps": 3,
            "task_mix": {"copy": 1.0}}
    assert logged_args(args) == {"out": "C", "init_from": "../B_fork.pt", "export": None, "steps": 3}
    shipped = logged_args({"out": "runs/I", "init_from": "k3-tiny-niah", "export": "runs/I/export"})
    assert shipped == {"out": "I", "init_from": "k3-tiny-niah", "export": "I/export"}


def test_the_documented_command_runs_from_the_training_folder():
    """training/README.md's `cd training && python -m k3ray_training.train`: the program from this
    folder, k3ray from the install (no PYTHONPATH)."""
    training = pathlib.Path(__file__).resolve().parents[2] / "training"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-m", "k3ray_training.train", "--help"], cwd=training, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--export" in run.stdout and "--value-readout" in run.stdout


def test_the_shipped_checkpoints_log_names_no_machine_path():
    log = pathlib.Path(__file__).resolve().parents[2] / "training" / "k3-tiny-niah" / LOG_FILE
    starts = [r["args"] for r in map(json.loads, log.read_text().splitlines()) if r.get("event") == "start"]
    assert len(starts) == 20
    paths = [a[k] for a in starts for k in ("out", "init_from", "export") if a.get(k)]
    assert paths and not [p for p in paths if os.path.isabs(p) or re.search(r"(^|/)(tmp|s\d+)(/|$)", p)]


def test_the_readme_reproduces_the_logged_stages():
    """training/README.md's commands name the log's stages in its order (stageF's and W1's export-only
    reruns are further start lines of theirs), each with the step count the log's stage ran to."""
    training = pathlib.Path(__file__).resolve().parents[2] / "training"
    starts = [r["args"] for r in map(json.loads, (training / "k3-tiny-niah" / LOG_FILE).read_text().splitlines())
              if r.get("event") == "start"]
    logged = [a["out"] for i, a in enumerate(starts) if i == 0 or a["out"] != starts[i - 1]["out"]]
    documented = re.findall(r"^    train --out R/(\w+)", (training / "README.md").read_text(), re.M)
    assert documented == logged and len(documented) == 18
    steps = {a["out"]: a["steps"] for a in starts}
    commands = dict(re.findall(r"^    train --out R/(\w+) .*?--steps (\d+)", (training / "README.md").read_text(), re.M))
    assert {name: int(n) for name, n in commands.items()} == steps


def test_training_starts_from_a_shipped_checkpoint_with_its_served_logits():
    config = CONFIGS["niah"]()
    model = trainable_model(config, seed=0)
    initial_weights(model, "k3-tiny-niah")  # MXFP4 experts dequantised into the dense ones
    served = K3.load("k3-tiny-niah", device="cpu")
    ids = ByteTokenizer().encode("One of the special magic numbers for calm-river is: 4812093. What is")
    want = served.logits(ids)
    with torch.no_grad():
        got = train_logits(model.eval(), torch.tensor([ids]), torch.arange(len(ids)))
    torch.testing.assert_close(got, want.float(), atol=2e-3, rtol=2e-3)


def test_init_from_names_what_it_cannot_load(tmp_path):
    model = trainable_model(CONFIGS["tiny"](), seed=0)
    with pytest.raises(ValueError, match="neither a train_state.pt nor a checkpoint"):
        initial_weights(model, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="does not match the model"):
        initial_weights(model, "k3-tiny-niah")  # the niah config's widths, not tiny's
    out = tmp_path / "run"
    main(["--out", str(out), "--steps", "1", *TINY_RUN])
    initial_weights(trainable_model(CONFIGS["tiny"](), seed=1), str(out / STATE_FILE))


def test_init_from_the_shipped_name_in_the_training_folder(monkeypatch):
    """training/k3-tiny-niah (the shipped checkpoint's log folder) is not the checkpoint the name means."""
    want = trainable_model(CONFIGS["niah"](), seed=0)
    initial_weights(want, "k3-tiny-niah")
    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2] / "training")
    model = trainable_model(CONFIGS["niah"](), seed=1)
    initial_weights(model, "k3-tiny-niah")
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor)


def test_carried_kda_states_continue_a_sequence_and_padding_writes_none():
    config = CONFIGS["tiny"]()
    model = trainable_model(config, seed=5).eval()
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(2))
    # one KDA layer, its short conv made a pass-through: then only the recurrent state links the two halves
    attn = next(layer.self_attn for layer in model.model.layers.values() if isinstance(layer.self_attn, KimiDeltaAttention))
    with torch.no_grad():
        for conv in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d):
            conv.weight.zero_()
            conv.weight[:, 0, -1] = 1.0
        x = model.embed(ids)  # [1, 48, D]
        whole = fixture_model._kda(attn, x)
        first = KdaCarry(torch.ones(1, 30, dtype=torch.bool))
        head = fixture_model._kda(attn, x[:, :30], first)
        second = KdaCarry(torch.ones(1, 18, dtype=torch.bool), {attn.layer_idx: first.final[attn.layer_idx]})
        tail = fixture_model._kda(attn, x[:, 30:], second)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole, atol=1e-5, rtol=1e-4)
    # through the whole model: a row padded past its 20 tokens ends in the states of those 20 tokens alone
    padded = torch.stack([ids[0], torch.cat([ids[0, :20], torch.zeros(28, dtype=torch.long)])])
    both = KdaCarry(torch.arange(48)[None] < torch.tensor([[48], [20]]))
    alone = KdaCarry(torch.ones(1, 20, dtype=torch.bool))
    with torch.no_grad():
        train_logits(model, padded, torch.tensor([0]), carry=both)
        train_logits(model, ids[:, :20], torch.tensor([0]), carry=alone)
    assert set(both.final) == {a.layer_idx for a in kda_layers(model)}
    for layer, state in alone.final.items():
        torch.testing.assert_close(both.final[layer][1:], state, atol=1e-5, rtol=1e-4)


def test_state_bank_ages_its_chains_and_items_draw_them():
    config = CONFIGS["tiny"]()
    model = trainable_model(config, seed=5).eval()
    bank = StateBank(2, carry=1.0)
    assert bank.ages() == [0, 0] and bank.chains == [None, None]
    rng = random.Random(0)
    for _ in range(2):
        bank.age(model, [haystack_ids("abc def. " * 40, rng, 64, ByteTokenizer().encode) for _ in range(2)])
    assert bank.ages() == [128, 128]
    states = bank.chains[0].states
    assert set(states) == {a.layer_idx for a in kda_layers(model)} and all(s.norm() > 0 for s in states.values())
    assert not torch.equal(states[min(states)], bank.chains[1].states[min(states)])  # two haystacks, two states
    assert all(bank.draw(rng) is not None for _ in range(20))
    assert all(StateBank(2, carry=0.0).draw(rng) is None for _ in range(20))
    starts = initial_states([None, bank.chains[1]], model)
    layer = min(starts)
    assert starts[layer].shape[0] == 2 and starts[layer][0].abs().sum() == 0
    assert torch.equal(starts[layer][1], bank.chains[1].states[layer])
    again = StateBank(2, carry=1.0)
    again.load_state_dict(bank.state_dict())
    assert again.ages() == [128, 128] and torch.equal(again.chains[1].states[layer], bank.chains[1].states[layer])
    with pytest.raises(ValueError, match="has 2 chains, this run asks for 3"):
        StateBank(3, carry=1.0).load_state_dict(bank.state_dict())
    with pytest.raises(ValueError, match="probability"):
        StateBank(1, carry=1.5)


def test_a_carrying_run_ages_its_states_each_step_and_resumes_them(tmp_path):
    carrying = ["--carry-state", "1.0", "--carry-chains", "2", "--carry-age", "64", "--carry-start-age", "128"]
    main(["--out", str(tmp_path / "whole"), "--steps", "4", *carrying, *TINY_RUN])
    records = [r for r in _log(tmp_path / "whole") if "loss" in r]
    assert [r["carried"]["max_age"] for r in records] == [192, 256, 320, 384]  # pre-aged 128, then 64 a step
    assert all(r["carried"]["items"] == r["carried"]["of"] for r in records)
    state = torch.load(tmp_path / "whole" / STATE_FILE, weights_only=True)
    assert [c["age"] for c in state["state_bank"]["chains"]] == [384, 384]
    main(["--out", str(tmp_path / "halves"), "--steps", "4", "--stop-at", "2", *carrying, *TINY_RUN])
    main(["--out", str(tmp_path / "halves"), "--steps", "4", *carrying, *TINY_RUN])
    assert _losses(tmp_path / "halves") == pytest.approx(_losses(tmp_path / "whole"), rel=1e-3)
    with pytest.raises(SystemExit, match="probability"):
        main(["--out", str(tmp_path / "bad"), "--steps", "1", "--carry-state", "1.5", *TINY_RUN])
