"""The per-cell JSONL log: one record per finished (or failed) cell, appended as cells complete."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, TextIO

from k3ray.evals.scoring import score
from k3ray.evals.target import Prompt, Target
from k3ray.evals.tasks.base import Cell, Task


def prompt_digest(prompt: Prompt) -> str:
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def evaluate_cell(
    task: Task, target: Target, cell: Cell, seed: int, reserve_generation: bool = False, chat: bool = False
) -> dict[str, Any]:
    """Build, ask, score one cell (`chat`: a text prompt as a user message). A failure becomes a
    record with `error` set, retried on resume."""
    record: dict[str, Any] = {"key": cell.key, "task": cell.task, "length": cell.length, "depth": cell.depth,
                              "sample": cell.sample}
    start = time.perf_counter()
    try:
        item = task.build(cell, target, seed, reserve_generation, chat)
        prediction = target.complete(item.prompt, item.max_tokens)
        record |= {
            "needle_depth": item.needle_depth,
            "prompt_tokens": item.prompt_tokens,
            "prompt_sha256": prompt_digest(item.prompt),
            "max_tokens": item.max_tokens,
            "metric": item.metric,
            "answers": list(item.answers),
            "prediction": prediction,
            "score": score(prediction, item.answers, item.metric),
            "error": None,
        }
    except Exception as e:  # noqa: BLE001 - an endpoint failure must not stop the other cells
        record |= {"score": None, "error": f"{type(e).__name__}: {e}"}
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def append_record(out: TextIO, record: dict[str, Any]) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def load_records(path: Path) -> dict[str, dict[str, Any]]:
    """The last record of each cell key; a line cut short by a crash is skipped."""
    records: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "key" in record:
            records[record["key"]] = record
    return records


def finished(records: dict[str, dict[str, Any]]) -> set[str]:
    return {key for key, r in records.items() if r.get("error") is None and r.get("score") is not None}
