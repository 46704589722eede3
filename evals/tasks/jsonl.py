"""Items from a user's JSONL file, read through `datasets` (RULER's prepared-data format works).

One object per line: `input` (or `prompt`): text or OpenAI chat messages; `outputs` (or
`answers`): reference strings; optional `answer_prefix` (appended to a text input), `length` and
`depth` (the report's axes), `metric` ("all" | "part") and `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3ray.evals.scoring import METRICS
from k3ray.evals.target import Target, as_user_message, count_chat_tokens, count_tokens
from k3ray.evals.tasks.base import Cell, Item, Task


def _without_nulls(value: Any) -> Any:
    # Arrow gives every struct in a column the union of their fields, missing ones as None
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


@dataclass(frozen=True)
class JsonlTask(Task):
    name: str
    rows: tuple[dict[str, Any], ...]
    max_tokens: int = 128

    def cells(self, lengths: Sequence[int], depths: Sequence[float] | None, samples: int) -> list[Cell]:
        """One cell per row; the run's lengths, depths and samples do not apply."""
        return [Cell(self.name, int(row.get("length") or 0), row.get("depth"), i) for i, row in enumerate(self.rows)]

    def build(self, cell: Cell, target: Target, seed: int, reserve_generation: bool = False,
              chat: bool = False) -> Item:
        """`chat`: a text input, answer prefix included, goes as one user message (as RULER's files do
        through a chat API)."""
        row = self.rows[cell.sample]
        prompt = row.get("input", row.get("prompt"))
        if isinstance(prompt, str):
            prompt += row.get("answer_prefix") or ""
            if chat:
                prompt = as_user_message(prompt)
        answers = row.get("outputs", row.get("answers"))
        metric = row.get("metric") or "all"
        tokens = count_tokens(target, prompt) if isinstance(prompt, str) else count_chat_tokens(target, prompt)
        return Item(prompt, tuple(answers), metric, int(row.get("max_tokens") or self.max_tokens), tokens, cell.depth)


def load_jsonl_task(path: str | Path, name: str | None = None) -> JsonlTask:
    # lazy: datasets (the eval extra, seconds to import) only when a task file is read
    import datasets

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist")
    rows = [_without_nulls(r) for r in datasets.load_dataset("json", data_files=str(path), split="train").to_list()]
    for i, row in enumerate(rows):
        prompt, answers = row.get("input", row.get("prompt")), row.get("outputs", row.get("answers"))
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ValueError(f"{path} line {i + 1}: 'input' (or 'prompt') must be text or chat messages")
        if isinstance(answers, str) or not answers or not all(isinstance(a, str) for a in answers):
            raise ValueError(f"{path} line {i + 1}: 'outputs' (or 'answers') must be a list of strings")
        if row.get("metric", "all") not in METRICS:
            raise ValueError(f"{path} line {i + 1}: metric must be one of {METRICS}, got {row['metric']!r}")
    if not rows:
        raise ValueError(f"task file {str(path)!r} holds no items")
    return JsonlTask(name or f"jsonl:{path.stem}", tuple(rows))
