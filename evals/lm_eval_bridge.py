"""lm-evaluation-harness against an OpenAI-compatible server, or against k3ray's in-process model.

    info = probe_server("http://127.0.0.1:8000")
    results, path = run_lm_eval(["k3ray_mc", "k3ray_gen"], "local-completions",
                                local_completions_args(info), out_dir="out/")

Against a server, lm-eval's stock `local-completions` model runs with long-context-safe settings:
`max_length` is the server's context (from /tokenizer_info or /tokenize, not lm-eval's 2048 that
silently left-truncates), a long timeout, the server's own tokenizer (`tokenizer_backend=remote`)
with token-id prompts, so the lengths lm-eval counts are the ones the model sees. A server without
the tokenizer routes gets text prompts and no tokenizer: generation tasks only. The offline task
YAMLs in `lm_eval_tasks/` are always on the include path; the hubs are switched offline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
DEFAULT_TIMEOUT_S = 7200  # a 1M-token prefill on a busy server takes minutes
SECRET_MODEL_ARGS = ("auth_token", "header")
# model_args the shipped task loaders read (through lm-eval's task metadata)
TASK_METADATA_KEYS = ("base_url", "model", "pretrained", "tokenizer")


@dataclass(frozen=True)
class ServerInfo:
    root: str
    model: str
    max_model_len: int | None
    remote_tokenizer: bool


def server_root(endpoint: str) -> str:
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(f"endpoint must start with http:// or https://, got {endpoint!r}")
    root = endpoint.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if root.endswith(suffix):
            return root[: -len(suffix)]
    return root


def _get_json(client: httpx.Client, method: str, route: str, **kwargs) -> dict | None:
    try:
        response = client.request(method, route, **kwargs)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {client.base_url}{route}: {type(e).__name__}: {e}") from e
    if response.status_code != 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def probe_server(endpoint: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 30.0) -> ServerInfo:
    """The served model name, its context length and whether vLLM's tokenizer routes answer."""
    root = server_root(endpoint)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=root, headers=headers, timeout=timeout) as client:
        models = _get_json(client, "GET", "/v1/models") or {}
        cards = models.get("data") or []
        if model is None:
            if not cards:
                raise ValueError(f"{root}/v1/models lists no model; pass the served model name (--served-model-name)")
            model = cards[0]["id"]
        info = _get_json(client, "GET", "/tokenizer_info") or {}
        tokenized = _get_json(client, "POST", "/tokenize",
                              json={"model": model, "prompt": "test", "add_special_tokens": False}) or {}
    card = next((c for c in cards if c.get("id") == model), {})
    lengths = [info.get("model_max_length"), tokenized.get("max_model_len"), card.get("max_model_len")]
    max_model_len = next((int(n) for n in lengths if isinstance(n, int) and n > 0), None)
    remote = "eos_token" in info and isinstance(tokenized.get("tokens"), list)
    return ServerInfo(root, model, max_model_len, remote)


def local_completions_args(info: ServerInfo, *, max_length: int | None = None, num_concurrent: int = 1,
                           timeout: int = DEFAULT_TIMEOUT_S, max_retries: int = 3,
                           api_key: str | None = None) -> dict[str, Any]:
    """model_args for lm-eval's `local-completions` against this server."""
    if max_length is None:
        if info.max_model_len is None:
            raise ValueError(f"{info.root} does not say its context length (no /tokenizer_info or /tokenize "
                             "max_model_len): pass --max-model-len")
        max_length = info.max_model_len
    if max_length < 2 or (info.max_model_len is not None and max_length > info.max_model_len):
        raise ValueError(f"max_length must be in [2, {info.max_model_len}] (the server's context), got {max_length}")
    if num_concurrent < 1 or timeout < 1 or max_retries < 1:
        raise ValueError(f"num_concurrent, timeout and max_retries must be >= 1, got "
                         f"{num_concurrent}, {timeout}, {max_retries}")
    args: dict[str, Any] = {
        "model": info.model, "base_url": f"{info.root}/v1/completions", "max_length": max_length,
        "num_concurrent": num_concurrent, "max_retries": max_retries, "timeout": timeout, "batch_size": 1,
    }
    if info.remote_tokenizer:
        args |= {"tokenizer_backend": "remote", "tokenized_requests": True}
    else:
        args |= {"tokenizer_backend": "none", "tokenized_requests": False}
    if api_key:
        args |= {"auth_token": api_key, "header": {"Authorization": f"Bearer {api_key}"}}
    return args


def _task_manager(tasks: Sequence[str], include_path: Sequence[str], metadata: dict[str, Any]):
    # lazy: lm-eval (the eval extra, seconds to import) only for `k3ray eval lm-eval`: endpoint evals use probe_server alone
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR), *map(str, include_path)]
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if all(manager.match_tasks([t]) for t in tasks):
        return manager  # indexing lm-eval's ~15k built-in tasks takes seconds: only when asked for
    manager = TaskManager(include_path=paths, metadata=metadata)
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        raise ValueError(f"unknown lm-eval task(s) {missing}; shipped offline tasks: "
                         f"{', '.join(sorted(p.stem for p in TASKS_DIR.glob('*.yaml')))}")
    return manager


def run_lm_eval(tasks: Sequence[str], model: str, model_args: dict[str, Any], *, out_dir: str | Path | None = None,
                include_path: Sequence[str] = (), limit: float | None = None, metadata: dict[str, Any] | None = None,
                log_samples: bool = False, apply_chat_template: bool = False,
                seed: int = 0) -> tuple[dict[str, Any], Path | None]:
    """Run `tasks` with lm-eval's `simple_evaluate`; write lm-eval's results JSON (and per-task
    samples with log_samples) under out_dir. Returns (results, results JSON path or None)."""
    if not tasks:
        raise ValueError("tasks must name at least one lm-eval task")
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    # lazy: lm-eval (the eval extra, seconds to import) only for `k3ray eval lm-eval`: endpoint evals use probe_server alone
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    if model == "k3ray":
        # lazy: lm-eval (the eval extra, seconds to import) only for `k3ray eval lm-eval`: endpoint evals use probe_server alone
        import k3ray.evals.lm_eval_model  # noqa: F401 - registers the model

    task_metadata = {k: model_args[k] for k in TASK_METADATA_KEYS if model_args.get(k) is not None}
    manager = _task_manager(tasks, include_path, task_metadata | (metadata or {}))
    tracker = EvaluationTracker(output_path=str(out_dir)) if out_dir is not None else None
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=list(tasks), limit=limit, task_manager=manager,
        log_samples=log_samples, evaluation_tracker=tracker, apply_chat_template=apply_chat_template,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
    )
    if results is None:
        raise RuntimeError("lm-eval returned no results (a non-zero rank of a distributed run)")
    _redact(results)
    return results, (_save(tracker, results, log_samples) if tracker is not None else None)


def _redact(results: dict[str, Any]) -> None:
    config_args = results.get("config", {}).get("model_args")
    if isinstance(config_args, dict):
        for key in SECRET_MODEL_ARGS:
            if key in config_args:
                config_args[key] = "<redacted>"


def _save(tracker, results: dict[str, Any], log_samples: bool) -> Path:
    """lm-eval's own layout: OUT/<model>/results_<time>.json (+ samples_<task>_<time>.jsonl)."""
    samples = results.pop("samples", None) if log_samples else None
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task_name in results["configs"]:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
        results["samples"] = samples
    tracker_config = tracker.general_config_tracker
    path = Path(tracker.output_path) / str(tracker_config.model_name_sanitized) / f"results_{tracker.date_id}.json"
    if not path.is_file():  # lm-eval logs a failed save as a warning only
        raise RuntimeError(f"lm-eval did not write {path}")
    return path
