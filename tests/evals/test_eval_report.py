"""summary.json, heatmap.png, report.md and report.html: existence and content."""

import json

from PIL import Image

from k3ray.evals import heatmap, report
from k3ray.evals.heatmap import length_axis_label, length_label
from k3ray.evals.tasks import TASKS

CONFIG = {"tasks": ["niah", "vt"], "lengths": [1024, 1 << 20], "seed": 0, "samples": 10,
          "target": "k3@http://127.0.0.1:8000"}


def _record(task, length, depth, score, error=None):
    return {"key": f"{task}/{length}/{depth}", "task": task, "length": length, "depth": depth,
            "score": None if error else score, "error": error}


RECORDS = [
    _record("niah", 1024, 0.0, 1.0), _record("niah", 1024, 100.0, 0.0),
    _record("niah", 1 << 20, 0.0, 1.0), _record("niah", 1 << 20, 100.0, 1.0),
    _record("vt", 1024, 0.0, 0.5), _record("vt", 1 << 20, 0.0, 0.0, error="TimeoutError: slow"),
]


def test_summary_grid_and_breakdowns():
    summary = report.summarize(RECORDS, [TASKS["niah"], TASKS["vt"]], CONFIG)
    assert summary["lengths"] == [1024, 1 << 20] and summary["depths"] == [0.0, 100.0]
    assert summary["accuracy"] == round(3.5 / 5, 6) and summary["n"] == 5 and summary["errors"] == 1
    assert summary["grid"] == [[0.75, 0.0], [1.0, 1.0]]
    assert summary["by_length"] == {"1024": 0.5, str(1 << 20): 1.0}
    vt = summary["tasks"]["vt"]
    assert vt["accuracy"] == 0.5 and vt["grid"] == [[0.5], [None]] and vt["depths"] == [0.0]
    assert summary["config"] == CONFIG


def test_report_files_exist_and_carry_the_numbers(tmp_path):
    summary = report.summarize(RECORDS, [TASKS["niah"], TASKS["vt"]], CONFIG)
    report.write_report(tmp_path, summary)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    with Image.open(tmp_path / "heatmap.png") as png:
        assert png.format == "PNG" and png.width > 300 and png.height > 200
        assert len(png.convert("RGB").getcolors(1 << 16) or []) > 50  # drawn, not blank
    md = (tmp_path / "report.md").read_text()
    assert "Overall accuracy 70.0% over 5 scored items in 5 cells (1 failed)." in md
    assert "| 0% | 75.0 | 100.0 |" in md and "| 100% | 0.0 | 100.0 |" in md
    assert "| vt | tokens | all | 1 | 1 | 50.0 | 50.0 | - |" in md
    assert "| target | k3@http://127.0.0.1:8000 |" in md and "![accuracy heatmap](heatmap.png)" in md
    page = (tmp_path / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<img src='heatmap.png'" in page
    assert "<td>75.0</td>" in page and "<td>k3@http://127.0.0.1:8000</td>" in page


def test_items_and_cells_are_counted_apart():
    """Two samples a cell: 18 items fill 9 cells; a random-depth cell is its task and length."""
    records = [_record("niah", n, d, 1.0) for n in (1024, 2048, 4096) for d in (0.0, 50.0, 100.0) for _ in range(2)]
    records += [_record("cwe", 4096, None, 0.0) for _ in range(3)]
    summary = report.summarize(records, [TASKS["niah"], TASKS["cwe"]], {"target": "oracle"})
    assert (summary["n"], summary["cells"]) == (21, 10)
    assert (summary["tasks"]["niah"]["n"], summary["tasks"]["niah"]["cells"]) == (18, 9)
    assert (summary["tasks"]["cwe"]["n"], summary["tasks"]["cwe"]["cells"]) == (3, 1)
    md = report.markdown(summary)
    assert "over 21 scored items in 10 cells (0 failed)." in md and "| niah | tokens | all | 18 | 9 |" in md


def test_html_escapes_what_it_shows(tmp_path):
    summary = report.summarize(RECORDS[:1], [TASKS["niah"]], {"target": "<script>x</script>"})
    page = report.html_report(summary)
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_random_depth_runs_plot_by_length(tmp_path):
    records = [_record("cwe", 4096, None, 1.0), _record("cwe", 8192, None, 0.0)]
    summary = report.summarize(records, [TASKS["cwe"]], {"target": "oracle"})
    assert summary["depths"] == [] and summary["grid"] == [[], []]
    report.write_report(tmp_path, summary)
    assert (tmp_path / "heatmap.png").stat().st_size > 1000
    assert "Accuracy (%) by depth" not in (tmp_path / "report.md").read_text()


def test_the_heatmap_is_titled_with_task_model_and_samples_per_cell():
    summary = report.summarize(RECORDS, [TASKS["niah"], TASKS["vt"]], CONFIG)
    assert heatmap.title(summary) == "niah, vt on k3@http://127.0.0.1:8000\n10 samples per cell, 70.0% overall"
    one = report.summarize(RECORDS[:1], [TASKS["niah"]], {"target": "engine:k3-tiny-niah", "samples": 1})
    assert heatmap.title(one) == "niah on engine:k3-tiny-niah\n1 sample per cell, 100.0% overall"


def test_length_labels():
    assert [length_label(n) for n in (1024, 4096, 1 << 20, 3000, 8)] == ["1k", "4k", "1m", "3000", "8"]


def test_length_axis_names_what_a_length_counts():
    def label(*names):
        return length_axis_label(report.summarize(RECORDS, [TASKS[n] for n in names], CONFIG))

    assert label("niah") == "context length (tokens)"
    assert label("image_niah") == "images per prompt" and label("video_niah") == "frames per video"
    assert label("image_niah", "video_niah") == "length (frames / images)"
