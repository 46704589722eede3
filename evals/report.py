"""summary.json, report.md and report.html from a run's records (accuracies are fractions in [0, 1]).

summary.json holds `lengths`, `depths`, `accuracy` (mean score of every scored item), `grid`
(`grid[i][j]`: mean score at lengths[i] x depths[j], null where no item ran; only items with an
explicit depth), `by_length`, per-task breakdowns under `tasks`, counts and the run's `config`.
Counts: `n` scored items (records), `cells` the task x length x depth cells they fill (the
samples of a cell are its items), `errors` failed items.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3ray.evals import heatmap
from k3ray.evals.heatmap import length_label
from k3ray.evals.tasks import Task


def _mean(records: Sequence[dict[str, Any]]) -> float | None:
    return round(sum(r["score"] for r in records) / len(records), 6) if records else None


def _cells(records: Sequence[dict[str, Any]]) -> int:
    return len({(r["task"], r["length"], r["depth"]) for r in records})


def _breakdown(records: Sequence[dict[str, Any]], lengths: list[int], depths: list[float]) -> dict[str, Any]:
    return {
        "accuracy": _mean(records),
        "n": len(records),
        "cells": _cells(records),
        "by_length": {str(n): _mean([r for r in records if r["length"] == n]) for n in lengths},
        "grid": [[_mean([r for r in records if (r["length"], r["depth"]) == (n, d)]) for d in depths] for n in lengths],
    }


def summarize(records: Sequence[dict[str, Any]], tasks: Sequence[Task], config: dict[str, Any]) -> dict[str, Any]:
    scored = [r for r in records if r.get("error") is None and r.get("score") is not None]
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records if r["depth"] is not None})
    overall = _breakdown(scored, lengths, depths)
    per_task = {}
    for task in tasks:
        mine = [r for r in scored if r["task"] == task.name]
        task_lengths = sorted({r["length"] for r in records if r["task"] == task.name})
        task_depths = sorted({r["depth"] for r in records if r["task"] == task.name and r["depth"] is not None})
        per_task[task.name] = {"unit": task.unit, "metric": task.metric, "depths": task_depths,
                               **_breakdown(mine, task_lengths, task_depths)}
    return {
        "lengths": lengths,
        "depths": depths,
        "accuracy": overall["accuracy"],
        "grid": overall["grid"],
        "by_length": overall["by_length"],
        "n": len(scored),
        "cells": overall["cells"],
        "errors": len(records) - len(scored),
        "tasks": per_task,
        "config": config,
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _tables(summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for every table of the report, shared by markdown and HTML."""
    config = summary["config"]
    settings = [[k, ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)] for k, v in config.items()]
    lengths = summary["lengths"]
    tables = [("Run configuration", ["setting", "value"], settings)]
    if summary["depths"]:
        rows = [[f"{d:g}%"] + [_pct(summary["grid"][i][j]) for i in range(len(lengths))]
                for j, d in enumerate(summary["depths"])]
        tables.append(("Accuracy (%) by depth x length", ["depth"] + [length_label(n) for n in lengths], rows))
    per_task = [[name, t["unit"], t["metric"], str(t["n"]), str(t["cells"]), _pct(t["accuracy"])]
                + [_pct(t["by_length"].get(str(n))) for n in lengths] for name, t in summary["tasks"].items()]
    tables.append(("Accuracy (%) by task and length", ["task", "unit", "metric", "items", "cells", "all"]
                   + [length_label(n) for n in lengths], per_task))
    return tables


def _headline(summary: dict[str, Any]) -> str:
    return (f"Overall accuracy {_pct(summary['accuracy'])}% over {summary['n']} scored items in "
            f"{summary['cells']} cells ({summary['errors']} failed).")


def markdown(summary: dict[str, Any]) -> str:
    lines = [f"# k3ray eval: {summary['config'].get('target', '')}", "", _headline(summary), "",
             "![accuracy heatmap](heatmap.png)", ""]
    for title, header, rows in _tables(summary):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def html_report(summary: dict[str, Any]) -> str:
    esc = html.escape
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>k3ray eval</title>"
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1.5em}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#eee}</style></head><body>",
             f"<h1>k3ray eval: {esc(str(summary['config'].get('target', '')))}</h1>",
             f"<p>{esc(_headline(summary))}</p>", "<img src='heatmap.png' alt='accuracy heatmap'>"]
    for title, header, rows in _tables(summary):
        parts.append(f"<h2>{esc(title)}</h2><table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(out_dir: str | Path, summary: dict[str, Any]) -> None:
    out = Path(out_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    heatmap.plot(summary, out / "heatmap.png")
    (out / "report.md").write_text(markdown(summary))
    (out / "report.html").write_text(html_report(summary))
