"""`k3ray eval`: argument parsing and offline runs with the built-in oracles."""

import argparse
import json
import re

import pytest

from k3ray.evals import cli as eval_cli


def _main(*argv):
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    return eval_cli.main(parser.parse_args([*argv, "--executor", "threads"]))


def test_lengths_take_k_and_m_suffixes():
    assert eval_cli.parse_lengths("1k, 4K,1m,3000") == (1024, 4096, 1_048_576, 3000)
    for bad in ("1g", "k", "-4k", "1.5k", ","):
        with pytest.raises(ValueError, match="--lengths"):
            eval_cli.parse_lengths(bad)


def test_depths_are_percentages():
    assert eval_cli.parse_depths("0,50%,100") == (0.0, 50.0, 100.0)
    assert eval_cli.parse_depths("") == ()
    with pytest.raises(ValueError, match="--depths"):
        eval_cli.parse_depths("0,150")
    with pytest.raises(ValueError, match="--depths"):
        eval_cli.parse_depths("middle")


def test_niah_with_the_right_oracle_writes_every_output(tmp_path, capsys):
    out = tmp_path / "niah"
    assert _main("niah", "--oracle", "right", "--lengths", "1k,2k", "--depths", "0,50,100", "--out", str(out),
                 "--samples", "2", "--concurrency", "2", "--no-progress") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == 1.0 and summary["lengths"] == [1024, 2048] and summary["depths"] == [0, 50, 100]
    assert {p.name for p in out.iterdir()} == {"results.jsonl", "config.json", "summary.json", "heatmap.png",
                                                "report.md", "report.html"}
    assert "accuracy 100.0% over 12 items in 6 cells, 0 failed" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--resume"):
        _main("niah", "--oracle", "right", "--lengths", "1k", "--depths", "50", "--out", str(out), "--no-progress")
    assert _main("niah", "--oracle", "right", "--lengths", "1k,2k", "--depths", "0,50,100", "--out", str(out),
                 "--samples", "2", "--resume", "--no-progress") == 0


def test_ruler_suite_with_the_wrong_oracle_scores_zero(tmp_path):
    out = tmp_path / "ruler"
    assert _main("ruler", "--oracle", "wrong", "--tasks", "niah_single_1,vt", "--tasks", "fwe", "--lengths", "3000",
                 "--out", str(out), "--no-progress") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == 0.0 and set(summary["tasks"]) == {"niah_single_1", "vt", "fwe"}


def test_mm_suite_counts_images(tmp_path):
    out = tmp_path / "mm"
    assert _main("mm", "--oracle", "right", "--lengths", "2,5", "--out", str(out), "--no-progress") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == 1.0 and summary["lengths"] == [2, 5]
    assert summary["tasks"]["video_niah"]["unit"] == "frames"


def test_endpoint_without_a_served_model_name_asks_the_server(tmp_path):
    with pytest.raises(ValueError, match=r"cannot reach http://127.0.0.1:9/v1/models"):
        _main("niah", "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path), "--no-progress")


def test_cwe_below_its_minimum_length_fails_before_any_cell(tmp_path):
    """The minimum is known up front (100 list items in the target's tokens): no cell runs, nothing is written."""
    out = tmp_path / "cwe"
    with pytest.raises(ValueError, match=r"task cwe needs --lengths of at least (\d+) tokens .* got 1024") as error:
        _main("ruler", "--oracle", "right", "--tasks", "cwe,niah_single_1", "--lengths", "1k,4k", "--out", str(out),
              "--no-progress")
    assert not (out / "results.jsonl").exists()
    minimum = int(re.search(r"at least (\d+)", str(error.value)).group(1))
    assert 1024 < minimum < 4096
    assert _main("ruler", "--oracle", "right", "--tasks", "cwe", "--lengths", str(minimum), "--out", str(out),
                 "--no-progress") == 0
    assert json.loads((out / "summary.json").read_text())["accuracy"] == 1.0
