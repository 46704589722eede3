"""RULER-style non-needle tasks (vt, cwe, fwe) and RULER's string-match scoring."""

import dataclasses
import re
from collections import Counter

import pytest

from k3ray.evals.oracle import OracleTarget, corrupt
from k3ray.evals.scoring import score, string_match_all, string_match_part
from k3ray.evals.tasks import SUITES, TASKS, Cell
from k3ray.evals.tasks.templates import TEMPLATES, fwe_wording

RIGHT, WRONG = OracleTarget(), OracleTarget(wrong=True)


def _item(name, length=3000, depth=None, sample=0, template=None):
    task = TASKS[name] if template is None else dataclasses.replace(TASKS[name], template=template)
    return task.build(Cell(name, length, depth, sample), RIGHT, 0)


@pytest.mark.parametrize("name", ["vt", "cwe", "fwe"])
@pytest.mark.parametrize("length", [2500, 6000])
@pytest.mark.parametrize("sample", [0, 1])
def test_right_oracle_scores_100_and_wrong_scores_0(name, length, sample):
    item = _item(name, length, sample=sample)
    assert len(RIGHT.tokenize(item.prompt)) == length
    assert score(RIGHT.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 1.0
    assert score(WRONG.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 0.0


@pytest.mark.parametrize("depth", [0.0, 50.0, 100.0])
def test_variable_chain_is_in_order_and_complete(depth):
    item = _item("vt", depth=depth)
    assert len(item.answers) == 5
    first, *rest = item.answers
    value = re.search(rf"VAR {first} = (\d+)\.", item.prompt).group(1)
    positions = [item.prompt.index(f"VAR {first} = {value}.")]
    for prev, name in zip(item.answers, rest, strict=False):
        positions.append(item.prompt.index(f"VAR {name} = VAR {prev}."))
    assert positions == sorted(positions)
    assert f"assigned the value {value}" in item.prompt


@pytest.mark.parametrize("template", TEMPLATES)
def test_common_words_frequencies(template):
    item = _item("cwe", 8000, template=template)
    # k3ray's list has a numbered word a line, RULER's runs on one line ("1. a 2. b ...")
    counts = Counter(re.findall(r"(?:^|\s)\d+\. ([a-z]+)(?=\s|$)", item.prompt[: item.prompt.index("\nQuestion:")]))
    common = {w: counts[w] for w in item.answers}
    assert len(common) == 10 and len(set(common.values())) == 1
    freq = next(iter(common.values()))
    assert freq > max(c for w, c in counts.items() if w not in common)


@pytest.mark.parametrize("template", TEMPLATES)
def test_frequent_words_follow_zipf(template):
    item = _item("fwe", 8000, template=template)
    head = fwe_wording(template, 3).head
    body = item.prompt[len(head) : item.prompt.index("\nQuestion:")]
    ranked = Counter(w for w in body.split() if w.isalpha()).most_common(5)
    assert [w for w, _ in ranked[:3]] == list(item.answers)
    # alpha = 2: rank r appears about 1/r^2 as often as rank 1
    assert ranked[0][1] / ranked[1][1] == pytest.approx(4, rel=0.1)
    assert ranked[0][1] / ranked[2][1] == pytest.approx(9, rel=0.15)


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name,length", [("cwe", 700), ("fwe", 300), ("fwe", 120)])
def test_lists_too_short_for_a_length_are_refused(name, length, template):
    with pytest.raises(ValueError, match="too short"):
        _item(name, length, template=template)


def test_ruler_suite_lists_thirteen_minus_qa():
    assert len(SUITES["ruler"]) == 11 and all(n in TASKS for n in SUITES["ruler"])


def test_string_match_all_is_the_fraction_found():
    refs = ["1234567", "Brave-Lantern", "42", "uuid-x"]
    assert string_match_all("they are 1234567 and brave-lantern", refs) == 0.5
    assert string_match_all("1234567 BRAVE-LANTERN 42 uuid-x", refs) == 1.0
    assert string_match_all("nothing", refs) == 0.0


def test_string_match_part_is_any_found():
    assert string_match_part("it is 42", ["1234567", "42"]) == 1.0
    assert string_match_part("it is 43", ["1234567", "42"]) == 0.0
    assert score("it is 42", ["1234567", "42"], "part") == 1.0


def test_scoring_refuses_bad_input():
    with pytest.raises(ValueError, match="metric"):
        score("x", ["x"], "exact")
    with pytest.raises(ValueError, match="empty"):
        string_match_all("x", [])


def test_corrupt_changes_every_character_class():
    assert corrupt("1234567, brave-lantern") == "6789012, oenir-ynagrea"
