"""NIAH generators: oracle scores, needle placement, determinism, sentence-boundary insertion."""

import dataclasses
import re

import pytest

from k3ray.evals import haystack as hs
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.scoring import score
from k3ray.evals.tasks import TASKS, Cell, niah
from k3ray.evals.tasks.templates import TEMPLATES

NIAH_TASKS = [t.name for t in niah.TASKS]
RIGHT, WRONG = OracleTarget(), OracleTarget(wrong=True)


def _item(name, length=1200, depth=50.0, sample=0, seed=0, target=RIGHT):
    return TASKS[name].build(Cell(name, length, depth, sample), target, seed)


@pytest.mark.parametrize("name", NIAH_TASKS)
@pytest.mark.parametrize("depth", [0.0, 50.0, 100.0, None])
def test_right_oracle_scores_100_and_wrong_scores_0(name, depth):
    item = _item(name, depth=depth)
    assert len(RIGHT.tokenize(item.prompt)) == item.prompt_tokens == 1200
    assert score(RIGHT.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 1.0
    assert score(WRONG.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 0.0


@pytest.mark.parametrize("name,answers", [("niah_single_2", 1), ("niah_multivalue", 4), ("niah_multiquery", 4)])
def test_every_answer_is_a_needle_in_the_prompt(name, answers):
    item = _item(name)
    assert len(item.answers) == answers
    for value in item.answers:
        assert re.search(rf"One of the special magic \w+ for [\w-]+ is: {value}\.", item.prompt)


def test_multikey_distractors_do_not_answer():
    item = _item("niah_multikey_2", length=3000)
    values = re.findall(r"is: (\d+)\.", item.prompt)
    assert len(values) > 20 and item.answers[0] in values
    assert values.count(item.answers[0]) == 1


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("depth", [0.0, 25.0, 50.0, 75.0, 100.0])
def test_needle_sits_at_its_depth(depth, template):
    task = dataclasses.replace(TASKS["niah_single_1"], template=template)
    item = task.build(Cell("niah_single_1", 4000, depth, 0), RIGHT, 0)
    head_end = item.prompt.index("\n") + 1
    question = item.prompt.rindex("\nWhat ")
    where = item.prompt.index(f"is: {item.answers[0]}.")
    fraction = (where - head_end) / (question - head_end)
    # the needle moves back to a sentence start; noise sentences are under 25 characters of ~3,900
    assert depth / 100 - 0.02 <= fraction <= depth / 100 + 0.02, fraction


def test_generation_is_deterministic_per_seed_and_cell():
    assert _item("niah_multiquery").prompt == _item("niah_multiquery").prompt
    assert _item("niah_multiquery", seed=1).answers != _item("niah_multiquery").answers
    assert _item("niah_multiquery", sample=1).answers != _item("niah_multiquery").answers


def test_essay_haystack_is_the_bundled_corpus():
    corpus = hs.load_corpus()
    assert len(corpus) > 300_000 and corpus.startswith("In the beginning God created the heaven and the earth.")
    assert corpus.isascii()
    assert hs.essay_haystack().prefix(2 * len(corpus) + 5) == corpus + corpus + corpus[:5]


def test_user_haystack_file(tmp_path):
    path = tmp_path / "hay.txt"
    path.write_text("Alpha beta gamma. Delta epsilon.\n\nZeta eta theta. Iota kappa.\n")
    assert hs.load_corpus(str(path)).startswith("Alpha beta gamma. Delta epsilon.\n\nZeta eta theta.")
    task = TASKS["niah"].__class__("niah", corpus=str(path))
    item = task.build(Cell("niah", 600, 50.0), RIGHT, 0)
    assert "Zeta eta theta." in item.prompt and "In the beginning" not in item.prompt
    with pytest.raises(ValueError, match="does not exist"):
        hs.load_corpus(str(tmp_path / "missing.jsonl"))


def test_insert_at_depths_uses_sentence_starts():
    text = "One two. Three four five. Six."
    assert hs.insert_at_depths(text, [(0.0, "N.")]) == "N. One two. Three four five. Six."
    assert hs.insert_at_depths(text, [(0.5, "N.")]) == "One two. N. Three four five. Six."
    assert hs.insert_at_depths(text, [(1.0, "N.")]) == text + " N."
    assert hs.insert_at_depths(text, [(0.5, "A."), (0.5, "B.")]) == "One two. A. B. Three four five. Six."
    for fraction in (0.0, 0.3, 0.7, 1.0):
        assert len(hs.insert_at_depths(text, [(fraction, "N.")])) == len(text) + 3
    with pytest.raises(ValueError, match="depth fraction"):
        hs.insert_at_depths(text, [(1.5, "N.")])


def test_bad_task_settings_are_refused():
    with pytest.raises(ValueError, match="haystack"):
        niah.NeedleTask("x", haystack="poems")
    with pytest.raises(ValueError, match="num_queries"):
        niah.NeedleTask("x", num_keys=2, num_queries=3)
    with pytest.raises(ValueError, match="below the"):
        _item("niah", length=50)
