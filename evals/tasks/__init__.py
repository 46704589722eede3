"""Task registry: every generator by name, the suites the CLI runs, and the perfect readers."""

from __future__ import annotations

from k3ray.evals.tasks import common_words, freq_words, multimodal, niah, variable_tracking
from k3ray.evals.tasks.base import Cell, Item, Task

TASKS: dict[str, Task] = {
    t.name: t
    for t in (*niah.TASKS, *variable_tracking.TASKS, *common_words.TASKS, *freq_words.TASKS, *multimodal.TASKS)
}
SUITES: dict[str, tuple[str, ...]] = {
    "niah": ("niah",),
    "ruler": tuple(t.name for t in niah.TASKS if t.name != "niah") + ("vt", "cwe", "fwe"),
    "mm": ("image_niah", "video_niah"),
}
# each returns the answer a perfect reader gives, or None for a prompt of another task
READERS = (niah.read, variable_tracking.read, common_words.read, freq_words.read, multimodal.read)


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]


__all__ = ["Cell", "Item", "READERS", "SUITES", "TASKS", "Task", "get_task"]
