"""Run an eval grid against a target: resumable JSONL log, bounded concurrency, optional Ray shards.

`out/results.jsonl` gets one record per cell as it finishes; a rerun with `resume=True` skips
finished cells and retries failed ones. Cells run on a thread pool of `concurrency` workers, or,
when a Ray cluster is present (or `executor="ray"`), as Ray tasks with at most `concurrency` in
flight. Then `summary.json`, the heatmap and the reports are (re)written from the whole log.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3ray.evals import report
from k3ray.evals.progress import TokenProgress, cell_tokens
from k3ray.evals.results import append_record, evaluate_cell, finished, load_records
from k3ray.evals.target import Target, count_tokens, tokens_computed
from k3ray.evals.tasks import Cell, Task, get_task
from k3ray.evals.tasks.jsonl import load_jsonl_task
from k3ray.evals.tasks.templates import DEFAULT_TEMPLATE, check_template

EXECUTORS = ("auto", "threads", "ray")
# settings that change what a cell generates: a resumed run must keep them
_RESUME_KEYS = ("seed", "target", "haystack", "reserve_generation", "template", "chat")


@dataclass(frozen=True)
class RunConfig:
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...] = ()  # empty: a seeded random depth per cell, as RULER does
    samples: int = 1
    seed: int = 0
    concurrency: int = 4
    reserve_generation: bool = False  # length counts the generated tokens too (RULER's convention)
    haystack: str | None = None
    task_files: tuple[str, ...] = ()
    executor: str = "auto"
    template: str = DEFAULT_TEMPLATE  # the text tasks' prompt wording (templates.py): "k3ray" or RULER's "ruler"
    chat: bool = False  # text prompts go as one user message to the chat route, the template's tokens within length

    def __post_init__(self) -> None:
        check_template(self.template)
        if not self.tasks and not self.task_files:
            raise ValueError("tasks must name at least one task (or give a task file)")
        if any(length < 1 for length in self.lengths):
            raise ValueError(f"lengths must be >= 1, got {self.lengths}")
        if any(not 0 <= d <= 100 for d in self.depths):
            raise ValueError(f"depths are percentages in [0, 100], got {self.depths}")
        if self.samples < 1 or self.concurrency < 1:
            raise ValueError(f"samples and concurrency must be >= 1, got {self.samples}, {self.concurrency}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")


def resolve_tasks(config: RunConfig) -> list[Task]:
    tasks = [get_task(name) for name in config.tasks]
    tasks = [dataclasses.replace(t, template=config.template) if hasattr(t, "template") else t for t in tasks]
    if config.haystack is not None:
        tasks = [dataclasses.replace(t, corpus=config.haystack) if hasattr(t, "corpus") else t for t in tasks]
    return tasks + [load_jsonl_task(path) for path in config.task_files]


def _shortest_cells(jobs: Sequence[tuple[Task, Cell]]) -> list[tuple[Task, int]]:
    """(task, its shortest cell length) for each task among the jobs."""
    shortest: dict[str, tuple[Task, int]] = {}
    for task, cell in jobs:
        if task.name not in shortest or cell.length < shortest[task.name][1]:
            shortest[task.name] = (task, cell.length)
    return list(shortest.values())


def _check_context(target: Target, config: RunConfig, jobs: Sequence[tuple[Task, Cell]]) -> None:
    for task, shortest in _shortest_cells(jobs):
        if shortest < task.min_length:
            raise ValueError(f"task {task.name} needs --lengths of at least {task.min_length} {task.unit}, got {shortest}")
    text_jobs = [(t, c) for t, c in jobs if t.unit == "tokens"]
    if not text_jobs:
        return
    count_tokens(target, "ping")  # fails early on a server without /tokenize; learns max_model_len
    _check_min_lengths(target, config, text_jobs)
    if target.max_context is None:
        return
    for task, cell in text_jobs:
        needed = cell.length + (0 if config.reserve_generation else task.max_tokens)
        if needed > target.max_context:
            raise ValueError(
                f"{cell.key} needs {needed} tokens of context ({cell.length} prompt + {task.max_tokens} generated) "
                f"but {target.name} serves at most {target.max_context}; lower --lengths or pass --reserve-generation"
            )


def _check_min_lengths(target: Target, config: RunConfig, text_jobs: Sequence[tuple[Task, Cell]]) -> None:
    """A task whose prompt cannot be built at a length fails here, naming the length it needs."""
    count = functools.partial(count_tokens, target)
    for task, shortest in _shortest_cells(text_jobs):
        needed = task.min_prompt_tokens(count) + (task.max_tokens if config.reserve_generation else 0)
        if shortest < needed:
            raise ValueError(f"task {task.name} needs --lengths of at least {needed} tokens with {target.name}'s "
                             f"tokenizer, got {shortest}")


def _use_ray(executor: str) -> bool:
    if executor != "auto":
        return executor == "ray"
    ray = sys.modules.get("ray")
    return bool(os.environ.get("RAY_ADDRESS")) or (ray is not None and ray.is_initialized())


def _on_threads(jobs, target: Target, config: RunConfig, progress: TokenProgress) -> Iterator[dict[str, Any]]:
    def run(task: Task, cell: Cell) -> dict[str, Any]:
        progress.started(cell.key)
        return evaluate_cell(task, target, cell, config.seed, config.reserve_generation, config.chat)

    with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
        futures = [pool.submit(run, t, c) for t, c in jobs]
        for future in as_completed(futures):
            yield future.result()


def _evaluate_shard(shard, target: Target, seed: int, reserve_generation: bool, chat: bool) -> list[dict[str, Any]]:
    return [evaluate_cell(t, target, c, seed, reserve_generation, chat) for t, c in shard]


def _on_ray(jobs, target: Target, config: RunConfig, progress: TokenProgress) -> Iterator[dict[str, Any]]:
    # lazy: Ray only for --executor ray
    import ray

    from k3ray.actors.cluster.ray_connect import connect  # ray.init off the repository root

    if not ray.is_initialized():
        connect(address=os.environ.get("RAY_ADDRESS"))
    # a cell mostly waits on the endpoint, so two share a CPU
    remote = ray.remote(num_cpus=0.5)(_evaluate_shard)
    target_ref = ray.put(target)
    # about four shards per slot, so one slow shard does not hold up the end of the run
    shard_size = max(1, len(jobs) // (4 * config.concurrency))
    shards = [jobs[i : i + shard_size] for i in range(0, len(jobs), shard_size)]
    in_flight = []
    while shards or in_flight:
        while shards and len(in_flight) < config.concurrency:
            shard = shards.pop(0)
            for _, cell in shard:
                progress.started(cell.key)
            in_flight.append(remote.remote(shard, target_ref, config.seed, config.reserve_generation, config.chat))
        done, in_flight = ray.wait(in_flight, num_returns=1)
        yield from ray.get(done[0])


def run_eval(
    config: RunConfig, target: Target, out_dir: str | Path, *, resume: bool = False, progress: bool = True,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Run every unfinished cell of the grid, then write summary.json, heatmap.png and the reports.
    progress: a bar in tokens on stderr; on_progress(tokens, total, cells done) sees every update."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "results.jsonl"
    settings = {**dataclasses.asdict(config), "target": target.name}
    _check_resume(out, log, settings, resume)
    tasks = resolve_tasks(config)
    jobs = [(t, c) for t in tasks for c in t.cells(config.lengths, config.depths, config.samples)]
    keys = [c.key for _, c in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError("two cells share a key: a task is listed twice")
    done = finished(load_records(log))
    pending = [(t, c) for t, c in jobs if c.key not in done]
    if pending:
        _check_context(target, config, pending)
    (out / "config.json").write_text(json.dumps(settings, indent=2) + "\n")
    if pending:
        runner = _on_ray if _use_ray(config.executor) else _on_threads
        _end_last_line(log)
        tokens = {c.key: cell_tokens(t, c, config.reserve_generation) for t, c in pending}
        with log.open("a") as fh, TokenProgress(tokens, tokens_computed(target), enabled=progress,
                                                on_update=on_progress) as bar:
            for record in runner(pending, target, config, bar):
                append_record(fh, record)
                bar.finished(record["key"])
    records = load_records(log)
    summary = report.summarize([records[k] for k in keys if k in records], tasks, settings)
    report.write_report(out, summary)
    return summary


def _end_last_line(log: Path) -> None:
    # a crash can leave half a line; the next record must not be glued onto it
    if log.exists() and log.stat().st_size > 0:
        with log.open("rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                fh.write(b"\n")


def _check_resume(out: Path, log: Path, settings: dict[str, Any], resume: bool) -> None:
    if not log.exists() or log.stat().st_size == 0:
        return
    if not resume:
        raise ValueError(f"{log} already holds results: pass --resume to continue that run, or another --out")
    previous = json.loads((out / "config.json").read_text()) if (out / "config.json").exists() else {}
    changed = [k for k in _RESUME_KEYS if k in previous and previous[k] != settings[k]]
    if changed:
        details = ", ".join(f"{k}: {previous[k]!r} -> {settings[k]!r}" for k in changed)
        raise ValueError(f"cannot resume {out}: {details} changed, so finished cells would not match")
