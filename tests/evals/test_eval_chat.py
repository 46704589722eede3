"""`chat=True` (`k3ray eval --chat`): each text item goes as one user message, the same needles and
answers as its completion form, its chat template's tokens counted within the cell's length."""

import argparse
import dataclasses
import json

import pytest

from k3ray.evals import cli as eval_cli
from k3ray.evals.oracle import OracleTarget
from k3ray.evals.results import prompt_digest
from k3ray.evals.runner import RunConfig, run_eval
from k3ray.evals.target import chat_overhead
from k3ray.evals.tasks import TASKS, Cell

TEXT_TASKS = ("niah", "niah_single_1", "niah_multikey_1", "niah_multivalue", "vt", "cwe", "fwe")


@pytest.mark.parametrize("template", ["k3ray", "ruler"])
@pytest.mark.parametrize("name", TEXT_TASKS)
def test_a_chat_item_is_its_text_item_as_a_user_message_of_the_cell_s_length(name, template):
    task, target = dataclasses.replace(TASKS[name], template=template), OracleTarget()
    cell = Cell(name, 2048, 50.0)
    text, chat = task.build(cell, target, 0), task.build(cell, target, 0, chat=True)
    [message] = chat.prompt
    assert message["role"] == "user" and chat.answers == text.answers and chat.needle_depth == text.needle_depth
    overhead = chat_overhead(target)
    assert overhead > 0 and len(target.tokenize(message["content"])) == 2048 - overhead
    assert chat.prompt_tokens == target.count_chat_tokens(chat.prompt) == 2048
    # the same prompt with a little less haystack: its question and answer prefix close the user message
    assert message["content"].rsplit("\n", 1)[1] == text.prompt.rsplit("\n", 1)[1]


@pytest.mark.parametrize("wrong, expected", [(False, 1.0), (True, 0.0)])
def test_a_chat_grid_scores_like_its_text_grid(tmp_path, wrong, expected):
    config = RunConfig(tasks=TEXT_TASKS, lengths=(2048,), depths=(0.0, 100.0), chat=True, template="ruler",
                       executor="threads")
    summary = run_eval(config, OracleTarget(wrong=wrong), tmp_path, progress=False)
    assert summary["accuracy"] == expected and summary["errors"] == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["prompt_tokens"] for r in records} == {2048}
    assert json.loads((tmp_path / "config.json").read_text())["chat"] is True


def test_a_resumed_run_keeps_its_prompt_form(tmp_path):
    run_eval(RunConfig(tasks=("niah",), lengths=(1024,), depths=(50.0,), executor="threads"), OracleTarget(),
             tmp_path, progress=False)
    with pytest.raises(ValueError, match="chat: False -> True"):
        run_eval(RunConfig(tasks=("niah",), lengths=(1024,), depths=(50.0,), chat=True, executor="threads"),
                 OracleTarget(), tmp_path, resume=True, progress=False)


def test_a_task_file_s_text_rows_go_as_user_messages(tmp_path):
    item = TASKS["niah"].build(Cell("niah", 900, 10.0), OracleTarget(), 7)
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps({"input": item.prompt, "outputs": list(item.answers), "length": 900}) + "\n")
    seen = []

    class Recording(OracleTarget):
        def complete(self, prompt, max_tokens):
            seen.append(prompt)
            return super().complete(prompt, max_tokens)

    config = RunConfig(tasks=(), lengths=(1,), task_files=(str(path),), chat=True, executor="threads")
    summary = run_eval(config, Recording(), tmp_path / "run", progress=False)
    assert summary["accuracy"] == 1.0 and seen == [[{"role": "user", "content": item.prompt}]]


def test_a_target_that_cannot_count_chats_is_named():
    target = OracleTarget()
    target.count_chat_tokens = lambda messages: None  # as an endpoint whose /tokenize takes no messages
    with pytest.raises(ValueError, match="cannot count chat prompts"):
        TASKS["niah"].build(Cell("niah", 1024, 50.0), target, 0, chat=True)


def test_the_chat_flag_reaches_the_run(tmp_path):
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    out = tmp_path / "chat"
    args = parser.parse_args(["ruler", "--oracle", "right", "--tasks", "niah,cwe", "--lengths", "2k", "--chat",
                              "--template", "ruler", "--out", str(out), "--executor", "threads", "--no-progress"])
    assert eval_cli.main(args) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert json.loads((out / "config.json").read_text())["chat"] is True
    assert {r["prompt_tokens"] for r in records} == {2048} and {r["score"] for r in records} == {1.0}
    for record in records:
        item = dataclasses.replace(TASKS[record["task"]], template="ruler").build(
            Cell(record["task"], 2048, record["depth"]), OracleTarget(), 0, chat=True)
        assert record["prompt_sha256"] == prompt_digest(item.prompt)
