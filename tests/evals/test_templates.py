"""Prompt templates: `template="ruler"` writes RULER's own text, `"k3ray"` (the default) the project's,
both score through the tasks' readers, and `k3ray eval --template` reaches the tasks.

The expected RULER strings are written out from NVIDIA/RULER scripts/data/synthetic/constants.py
(TASKS[...]["template"] + ["answer_prefix"], as scripts/data/prepare.py joins them) and, for one
needle and one value, the rewrite in scripts/data/synthetic/niah.py ('Some' -> 'A', 'are all' -> 'is',
'are' -> 'is', the noun without its "s").
"""

import argparse
import dataclasses
import hashlib
import json
import re

import pytest

from k3ray.evals import cli as eval_cli
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.results import prompt_digest
from k3ray.evals.scoring import score
from k3ray.evals.tasks import TASKS, Cell, niah
from k3ray.evals.tasks.templates import TEMPLATES

RIGHT, WRONG = OracleTarget(), OracleTarget(wrong=True)


def _prompt(name, template, length=2000, depth=50.0, sample=0):
    task = dataclasses.replace(TASKS[name], template=template)
    return task.build(Cell(name, length, depth, sample), RIGHT, 0)


def _asked_keys(prompt):
    return re.search(r"special magic \w+ for (.+?) mentioned in the provided text\?", prompt).group(1)


def test_niah_single_needle_is_rulers_singular_form():
    item = _prompt("niah", "ruler")
    key = _asked_keys(item.prompt)
    assert item.prompt.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n")
    assert item.prompt.endswith(
        f"\nWhat is the special magic number for {key} mentioned in the provided text?"
        f" The special magic number for {key} mentioned in the provided text is")
    assert f"One of the special magic numbers for {key} is: {item.answers[0]}." in item.prompt


def test_niah_uuid_value_is_singular_too():
    item = _prompt("niah_single_3", "ruler", length=3000)
    key = _asked_keys(item.prompt)
    assert item.prompt.startswith("A special magic uuid is hidden within the following text. Make sure to memorize "
                                  "it. I will quiz you about the uuid afterwards.\n")
    assert item.prompt.endswith(f"? The special magic uuid for {key} mentioned in the provided text is")


def test_niah_several_values_use_rulers_plural_form():
    item = _prompt("niah_multivalue", "ruler")
    key = _asked_keys(item.prompt)
    assert item.prompt.startswith(
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n")
    assert item.prompt.endswith(
        f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?"
        f" The special magic numbers for {key} mentioned in the provided text are")


def test_niah_several_keys_are_joined_as_ruler_joins_them():
    query = _asked_keys(_prompt("niah_multiquery", "ruler").prompt)
    keys = re.fullmatch(r"(\S+), (\S+), (\S+), and (\S+)", query)
    assert keys is not None, query
    assert _asked_keys(_prompt("niah_multiquery", "ruler", sample=1).prompt).count(", and ") == 1


def test_vt_cwe_fwe_are_rulers_text():
    vt = _prompt("vt", "ruler")
    value = re.search(r"assigned the value (\d+) in", vt.prompt).group(1)
    assert vt.prompt.startswith(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
    assert vt.prompt.endswith(
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
        f" Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned "
        f"the value {value}, they are: ")
    cwe = _prompt("cwe", "ruler", length=3000)
    assert cwe.prompt.startswith(
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.\n1. ")
    assert re.match(r"[^\n]*\n1\. [a-z]+ 2\. [a-z]+ 3\. ", cwe.prompt[cwe.prompt.index("often.\n"):])
    assert cwe.prompt.endswith(
        "\nQuestion: What are the 10 most common words in the above list?"
        " Answer: The top 10 words that appear most often in the list are:")
    fwe = _prompt("fwe", "ruler", length=3000)
    assert fwe.prompt.startswith(
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words. ")
    assert fwe.prompt.endswith(
        "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
        "frequently appeared words in the above coded text? Answer: According to the coded text above, the three "
        "most frequently appeared words are:")


# sha256 of each k3ray-worded prompt (seed 0, 2500 tokens, random depth, sample 1) as the code before templates wrote it
K3RAY_PROMPTS = {"niah": "f9865ebedff79bec", "niah_multiquery": "a1375f1b5ccec628", "vt": "2aea38f3127eb00b",
                 "cwe": "9e87f45dbe6a1309", "fwe": "01f6bb3d95c87d62"}


def test_ruler_is_the_default_and_the_k3ray_variant_stays_byte_for_byte():
    for name, digest in K3RAY_PROMPTS.items():
        assert TASKS[name].template == "ruler"
        item = dataclasses.replace(TASKS[name], template="k3ray").build(Cell(name, 2500, None, 1), RIGHT, 0)
        assert hashlib.sha256(item.prompt.encode()).hexdigest()[:16] == digest, name  # byte for byte the old default
    assert TASKS["niah"].build(Cell("niah", 2000, 50.0, 0), RIGHT, 0).prompt == _prompt("niah", "ruler").prompt
    item = _prompt("niah", "k3ray")
    assert item.prompt.startswith("Some special magic numbers are hidden inside the following text.")
    assert item.prompt.endswith(" mentioned in the text above are")


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name", [t.name for t in niah.TASKS] + ["vt", "cwe", "fwe"])
def test_every_template_round_trips_through_scoring(name, template):
    length = 2500 if name in ("cwe", "fwe") else 1500
    item = _prompt(name, template, length=length, depth=None)
    assert len(RIGHT.tokenize(item.prompt)) == length
    assert score(RIGHT.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 1.0
    assert score(WRONG.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 0.0


def test_an_unknown_template_is_named():
    with pytest.raises(ValueError, match="template must be one of"):
        dataclasses.replace(TASKS["niah"], template="lm-eval")
    with pytest.raises(ValueError, match="template must be one of"):
        dataclasses.replace(TASKS["vt"], template="RULER")


def _main(*argv):
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    return eval_cli.main(parser.parse_args([*argv, "--executor", "threads", "--no-progress"]))


def test_template_flag_reaches_the_tasks(tmp_path):
    out = tmp_path / "ruler"
    assert _main("ruler", "--oracle", "right", "--tasks", "niah,vt", "--lengths", "1500", "--template", "ruler",
                 "--out", str(out)) == 0
    assert json.loads((out / "config.json").read_text())["template"] == "ruler"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for record in records:
        cell = Cell(record["task"], record["length"], record["depth"], 0)
        built = dataclasses.replace(TASKS[cell.task], template="ruler").build(cell, RIGHT, 0)
        assert record["prompt_sha256"] == prompt_digest(built.prompt) and record["score"] == 1.0
    with pytest.raises(ValueError, match="template: 'ruler' -> 'k3ray'"):
        _main("ruler", "--oracle", "right", "--tasks", "niah,vt", "--lengths", "1500", "--template", "k3ray",
              "--out", str(out), "--resume")
    with pytest.raises(SystemExit):
        _main("niah", "--oracle", "right", "--template", "plain", "--out", str(tmp_path / "x"))
