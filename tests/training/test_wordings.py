"""Training items in several wordings and formats: RULER's exact templates (the eval's "ruler"
prompts), paraphrase families, chat rendering with the answer in the assistant turn, the wording
and chat draws of a mix, and the held-out family that training never sees but the log scores."""

import dataclasses
import json
import random
import re

import pytest

from k3ray.evals.oracle import OracleTarget
from k3ray.evals.tasks import TASKS, Cell
from k3ray.checkpoints import shipped_checkpoint_dir
from k3ray.tokenizer import ByteTokenizer
from k3ray.tokenizer import special as sp
from k3ray.tokenizer.load import load_tokenizer
from k3ray_training import data, wordings
from k3ray_training.train import LOG_FILE, heldout_kinds, main, parse_args

TOK = ByteTokenizer()
IM_END = TOK.special_tokens[sp.IM_END]
SERVED = load_tokenizer(shipped_checkpoint_dir("k3-tiny-niah"))  # what /v1/chat/completions encodes with


def _ruler_item(name, length):
    return dataclasses.replace(TASKS[name], template="ruler").build(Cell(name, length, 50.0), OracleTarget(), 0)


@pytest.mark.parametrize("name, haystack", [("niah", 700), ("niah_multikey_1", 700), ("niah_multivalue", 700),
                                            ("niah_multiquery", 700), ("vt", 700), ("cwe", 1700), ("fwe", 1700)])
def test_ruler_items_are_the_evals_ruler_prompts_answered(name, haystack):
    rng = random.Random(0)
    for _ in range(3):
        ex = data.make_example(f"{name}@ruler", haystack, rng, TOK)
        assert ex.task == f"{name}@ruler"
        text = TOK.decode(ex.prompt)
        item = _ruler_item(name, len(ex.prompt))
        # the same head and the same answer prefix (up to the drawn keys and values) as k3ray eval --template ruler
        assert text[:60] == item.prompt[:60]
        assert re.sub(r"\d+", "#", text[-30:]) == re.sub(r"\d+", "#", item.prompt[-30:])
        assert ex.answer[-1] == TOK.eos_token_id
        answer = TOK.decode(ex.answer[:-1])
        assert all(ref in answer for ref in ex.references)
        # one space between the prefix and the answer: RULER's vt prefix brings its own
        assert (text + answer).count("  ") == text.count("  ") and (text + answer)[len(text)] != "\n"


@pytest.mark.parametrize("family", sorted(wordings.PARAPHRASES))
def test_paraphrase_items_answer_the_asked_values_in_the_readers_order(family):
    rng = random.Random(1)
    template = wordings.PARAPHRASES[family]
    for name in ("niah", "niah_multivalue", "niah_multiquery", "niah_multikey_2", "niah_single_3"):
        ex = data.make_example(f"{name}@{family}", 700, rng, TOK)
        text, answer = TOK.decode(ex.prompt), TOK.decode(ex.answer[:-1])
        assert data.reader_answer(text) is None  # no eval template's question
        form = template.singular if len(ex.references) == 1 else template.plural
        assert text.startswith(form.head.split("{")[0]) and form.question.split("{")[0] in text
        assert answer.startswith(" ") and all(ref in answer for ref in ex.references)
        values = [v for v in answer.strip().split(", ")]
        assert sorted(values) == sorted(ex.references)
        if name == "niah_multivalue":  # one key: its values in the order the text gives them
            assert values == sorted(values, key=text.find)
        needle = template.needle.split("{")[0]
        assert text.count(needle) >= len(ex.references)


def test_chat_items_put_the_answer_in_the_assistant_turn():
    rng = random.Random(2)
    forms = set()
    for _ in range(16):
        ex = data.make_example("niah@ruler+chat", 700, rng, TOK)
        assert ex.task == "niah@ruler+chat" and ex.answer[-1] == IM_END
        text = TOK.decode(ex.prompt)
        user = text.split("<|im_user|>user<|im_middle|>", 1)[1]
        assert text.count("<|im_system|>system<|im_middle|>") == 1  # the template's default or one drawn
        if text.endswith("<|im_assistant|>assistant<|im_middle|>"):  # the whole RULER prompt as the user's message
            forms.add("prompt")
            assert user.endswith(" mentioned in the provided text is<|im_end|><|im_assistant|>assistant<|im_middle|>")
            assert TOK.decode(ex.answer[:-1]) == ex.references[0]
        else:  # the question from the user, the answer prefix begun by the assistant
            forms.add("prefix")
            assert user.split("<|im_end|>")[0].endswith(" mentioned in the provided text?")
            assert text.endswith("<|im_assistant|>assistant<|im_middle|>The special magic number for "
                                 + re.search(r"for (\S+) mentioned in the provided text\?", text).group(1)
                                 + " mentioned in the provided text is")
            assert TOK.decode(ex.answer[:-1]) == " " + ex.references[0]
        # the prompt ids are the chat template's, as the server encodes the same messages with the checkpoint's
        messages = [{"role": "user", "content": user.split("<|im_end|>")[0]}]
        system = text.split("<|im_system|>system<|im_middle|>")[1].split("<|im_end|>")[0]
        if system != "You are Kimi, an AI assistant created by Moonshot AI.":
            messages.insert(0, {"role": "system", "content": system})
        if not text.endswith("<|im_middle|>"):
            messages.append({"role": "assistant", "content": text.rsplit("<|im_middle|>", 1)[1]})
            assert ex.prompt == SERVED.encode_chat(messages, continue_final_message=True)
        else:
            assert ex.prompt == SERVED.encode_chat(messages)
    assert forms == {"prompt", "prefix"}


def test_a_mix_draws_wordings_and_chat_each_task_in_those_it_takes():
    rng = random.Random(3)
    mix = {"niah": 0.4, "vt": 0.3, "cwe": 0.15, "fwe": 0.15, "copy": 0.1}
    families = {w: 1.0 for w in wordings.WORDINGS if w != wordings.HELDOUT_WORDING}
    kinds = [data.sample_example(1700, rng, TOK, mix, families, chat=0.3).task for _ in range(150)]
    parsed = [data.ItemKind.parse(k) for k in kinds]
    assert {k.wording for k in parsed if k.task == "niah"} == set(families)
    assert {k.wording for k in parsed if k.task in ("vt", "cwe", "fwe")} == {"k3ray", "ruler"}
    assert 0.15 < sum(k.chat for k in parsed) / sum(k.task != "copy" for k in parsed) < 0.45
    assert not any(k.chat or k.wording != "k3ray" for k in parsed if k.task == "copy")
    assert wordings.HELDOUT_WORDING not in {k.wording for k in parsed}
    # without wordings the draws are today's: plain task names, the same items for the same seed
    plain = [data.sample_example(700, random.Random(4), TOK, mix) for _ in range(2)]
    assert plain[0] == plain[1] and "@" not in plain[0].task


@pytest.mark.parametrize("spec, error", [("copy@ruler", "no wordings"), ("vt@para_find", "wordings"),
                                         ("niah@plain", "wordings"), ("needle", "unknown task")])
def test_item_kinds_that_cannot_be_built_are_named(spec, error):
    with pytest.raises(ValueError, match=error):
        data.ItemKind.parse(spec)


def test_wording_flags_are_checked_and_the_heldout_family_is_kept_out():
    args = parse_args(["--out", "x", "--wordings", "ruler=0.5,para_find=0.5", "--chat", "0.3"])
    kinds, family = heldout_kinds(args)
    assert family == ("niah@para_quiz", "niah@para_quiz+chat", "niah_multikey_1@para_quiz")
    assert set(family) < set(kinds) and "niah@ruler+chat" in kinds
    assert heldout_kinds(parse_args(["--out", "x"])) == (("niah", "niah_multikey_1", "vt", "recall"), ())
    for bad in (["--wordings", "para_quiz=1"], ["--tasks", "niah@para_quiz=1"], ["--chat", "0.5"],
                ["--wordings", "ruler=1", "--chat", "2"], ["--wordings", "poetry=1"], ["--tasks", "niah@poetry=1"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *bad])
    assert parse_args(["--out", "x", "--wordings", "para_quiz=1", "--heldout-wording", "para_list"]).wording_mix


def test_a_worded_run_logs_the_heldout_family_apart(tmp_path):
    out = tmp_path / "worded"
    main(["--out", str(out), "--config", "tiny", "--tokens-per-step", "600", "--max-haystack", "96", "--steps", "2",
          "--eval-every", "2", "--heldout-per-cell", "1", "--threads", "1", "--tasks", "niah=0.5,vt=0.5",
          "--wordings", "ruler=0.5,para_codes=0.5", "--chat", "0.5", "--eval-first"])
    lines = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    assert lines[0]["args"]["wordings"] == "ruler=0.5,para_codes=0.5" and lines[0]["args"]["chat"] == 0.5
    assert lines[1]["step"] == 0 and lines[1]["event"] == "eval"  # the starting weights' scores
    assert set(lines[1]["heldout_wording"]) == set(lines[-1]["heldout_wording"])
    last = lines[-1]
    assert set(last["heldout_wording"]) == {"niah@para_quiz", "niah@para_quiz+chat", "niah_multikey_1@para_quiz"}
    assert {"niah@ruler", "niah@ruler+chat", "vt@ruler", "cwe@ruler", "fwe@ruler"} <= set(last["heldout"])
    assert not set(last["heldout"]) & set(last["heldout_wording"])
    assert all(0.0 <= v <= 1.0 for v in (*last["heldout"].values(), *last["heldout_wording"].values()))


def test_task_file_writes_kinds_the_eval_reads(tmp_path):
    from k3ray.evals.tasks.jsonl import load_jsonl_task
    from k3ray_training import task_file

    path = tmp_path / "heldout.jsonl"
    task_file.main(["--kinds", "niah@para_quiz,niah_multivalue@ruler+chat", "--haystack", "700", "--samples", "2",
                    "--out", str(path)])
    task = load_jsonl_task(path)
    items = [task.build(cell, OracleTarget(), 0) for cell in task.cells((), None, 1)]
    assert len(items) == 4
    raw, chat = items[:2], items[2:]
    for item in raw:
        assert item.prompt.startswith("Pay attention to the special magic number in the following passage")
        assert item.prompt.endswith(" is") and item.prompt.count(item.answers[0]) == 1
    for item in chat:
        (message,) = item.prompt
        assert message["role"] == "user" and message["content"].endswith("mentioned in the provided text are")
        assert len(item.answers) == 4 and all(a in message["content"] for a in item.answers)
    with pytest.raises(SystemExit):
        task_file.main(["--kinds", "niah", "--out", str(path)])
