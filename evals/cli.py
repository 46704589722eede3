"""`k3ray eval niah|ruler|mm`: long-context and multimodal needle evals against an OpenAI-style
endpoint (`--endpoint URL`, optionally `--served-model-name`), or a checkpoint in this process
(`--model DIR`: the same prompts and answers as the server gives, without HTTP).

Writes OUT/results.jsonl (one record per item, a cell's samples being its items; --resume skips
finished items), OUT/summary.json,
OUT/heatmap.png, OUT/report.md and OUT/report.html. `--oracle right|wrong` replaces the endpoint
with a built-in reader that answers everything right (or wrong), to check the harness offline.

`k3ray eval lm-eval --tasks ...`: lm-evaluation-harness tasks against an endpoint (its stock
`local-completions` model) or a checkpoint in this process (k3ray's `k3ray` lm-eval model), with
k3ray's offline task YAMLs on the include path; writes lm-eval's results JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import sys

from k3ray.api_keys import CLIENT_API_KEY_HELP, client_api_key
from k3ray.cli_flags import add_deprecated_alias
from k3ray.device_flags import add_device_argument, add_dtype_argument, add_enforce_eager_argument
from k3ray.evals.extra import require_eval_extra
from k3ray.threads import add_threads_argument, set_threads

HELP = "long-context and multimodal evals against an endpoint or engine"
SUITE_HELP = {
    "niah": "needle in a haystack over a context-length x needle-depth grid (gkamradt style)",
    "ruler": "RULER-style synthetic tasks: niah variants, variable tracking, common and frequent words",
    "mm": "multimodal needles: a code card among N images or on one of N video frames (video_order: the first of "
          "two cards)",
}
LM_EVAL_HELP = "lm-evaluation-harness tasks against an endpoint (local-completions) or a checkpoint in process"
DEFAULT_LENGTHS = {"niah": "4k,8k,16k,32k", "ruler": "4k", "mm": "4,16"}
DEFAULT_DEPTHS = {"niah": ",".join(str(d) for d in range(0, 101, 10)), "ruler": "", "mm": "0,50,100"}
_SUFFIXES = {"k": 1 << 10, "m": 1 << 20}


def parse_lengths(text: str) -> tuple[int, ...]:
    """"1k,4k,1m" -> (1024, 4096, 1048576); plain integers pass through."""
    lengths = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        scale = _SUFFIXES.get(part[-1], 1)
        digits = part[:-1] if part[-1] in _SUFFIXES else part
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"--lengths entries look like 4096, 4k or 1m, got {part!r}")
        lengths.append(int(digits) * scale)
    if not lengths:
        raise ValueError(f"--lengths names no length: {text!r}")
    return tuple(lengths)


def parse_depths(text: str) -> tuple[float, ...]:
    """"0,50,100" -> (0.0, 50.0, 100.0); empty means a random depth per cell."""
    depths = []
    for part in filter(None, (p.strip().rstrip("%") for p in text.split(","))):
        try:
            depth = float(part)
        except ValueError:
            raise ValueError(f"--depths entries are percentages like 0, 50, 100, got {part!r}") from None
        if not 0 <= depth <= 100:
            raise ValueError(f"--depths entries must be in [0, 100], got {depth:g}")
        depths.append(depth)
    return tuple(depths)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # lazy: numpy, PIL and tqdm (the tasks, the runner) load for `k3ray eval`, not for `k3ray --help`
    from k3ray.evals.runner import EXECUTORS
    from k3ray.evals.tasks import SUITES, TASKS
    from k3ray.evals.tasks.templates import DEFAULT_TEMPLATE, TEMPLATES

    suites = parser.add_subparsers(dest="suite", required=True)
    for suite, help_text in SUITE_HELP.items():
        p = suites.add_parser(suite, help=help_text, description=help_text)
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--endpoint", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
        where.add_argument("--oracle", choices=("right", "wrong"),
                           help="no server: a built-in always-right/wrong target")
        add_checkpoint_arguments(where, p)
        p.add_argument("--tasks", action="append", default=[],
                       help=f"task(s), comma-separated (default: {','.join(SUITES[suite])}); known: {', '.join(TASKS)}")
        add_deprecated_alias(p, "--task", "--tasks", action="append", dest="tasks")
        p.add_argument("--task-file", action="append", default=[],
                       help="a JSONL file of items to run as one more task (repeatable; default: none)")
        p.add_argument("--lengths", default=DEFAULT_LENGTHS[suite],
                       help="prompt lengths in tokens (k = 1024, m = 1048576), or image/frame counts for mm")
        p.add_argument("--depths", default=DEFAULT_DEPTHS[suite],
                       help="needle depths in percent; empty = random per cell" + ("" if DEFAULT_DEPTHS[suite] else
                                                                                  " (default: empty)"))
        p.add_argument("--samples", type=int, default=1, help="items per length x depth cell")
        p.add_argument("--seed", type=int, default=0, help="seed of the generated items")
        p.add_argument("--out", metavar="DIR", required=True, help="output folder")
        p.add_argument("--concurrency", type=int, default=4, help="requests in flight (one per cell)")
        p.add_argument("--resume", action="store_true", help="continue a run in --out, skipping items already scored")
        p.add_argument("--timeout", type=float, default=3600.0, help="seconds per HTTP request")
        p.add_argument("--haystack", help="JSONL (text field) or .txt file replacing the corpus (default: the bundled "
                       "public-domain one)")
        p.add_argument("--template", choices=TEMPLATES, default=DEFAULT_TEMPLATE,
                       help="the text tasks' prompt wording: RULER's templates and answer prefixes, or k3ray's own "
                            f"(default: {DEFAULT_TEMPLATE})")
        p.add_argument("--chat", action="store_true",
                       help="send each text prompt as one user message to /v1/chat/completions (as an OpenAI client's "
                            "chat call does), the chat template's tokens counted within --lengths")
        p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                       help="with --chat: the chat requests' chat_template_kwargs (default: none), e.g. "
                            "'{\"thinking\": false}' so K3 answers without thinking first (only content is scored)")
        p.add_argument("--reserve-generation", action="store_true",
                       help="a length counts the generated tokens too (RULER's convention), so 1m fits a 1m context")
        p.add_argument("--executor", choices=EXECUTORS, default="auto",
                       help="threads, or Ray tasks (auto: Ray when RAY_ADDRESS is set or Ray is initialised)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        engine = p.add_argument_group("in-process engine (--model)")
        engine.add_argument("--max-model-len", type=int, help="context limit (default: the model's and cache's)")
        engine.add_argument("--max-num-batched-tokens", type=int, default=8192,
                            help="tokens per engine step: the prefill chunk of a long prompt")
        engine.add_argument("--cache-memory-mb", type=float, default=1024.0, help="MLA cache + state budget")
        engine.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the checkpoint's own)")
        add_threads_argument(engine)
        add_device_argument(engine)
        add_dtype_argument(engine)
        add_enforce_eager_argument(engine)
    add_lm_eval_arguments(suites.add_parser("lm-eval", help=LM_EVAL_HELP, description=LM_EVAL_HELP))


def add_lm_eval_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    add_checkpoint_arguments(where, p)
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated (shipped offline: "
                   "k3ray_mc, k3ray_gen, k3ray_ppl, k3ray_niah)")
    p.add_argument("--max-model-len", type=int, help="context tokens (default: the server's / engine's max_model_len)")
    add_deprecated_alias(p, "--max-length", "--max-model-len", dest="max_model_len", type=int)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (endpoint)")
    add_deprecated_alias(p, "--num-concurrent", "--concurrency", dest="concurrency", type=int)
    p.add_argument("--timeout", type=int, default=7200, help="seconds per HTTP request (endpoint)")
    p.add_argument("--max-retries", type=int, default=3, help="retries of a failed request (endpoint)")
    p.add_argument("--limit", type=float, help="docs per task (a fraction below 1; default: all)")
    p.add_argument("--out", metavar="DIR", help="folder for lm-eval's results JSON and samples (default: print only)")
    p.add_argument("--include-path", action="append", default=[],
                   help="more task YAML folders (repeatable; default: k3ray's own only)")
    p.add_argument("--metadata", default="{}", help='JSON for the tasks, e.g. \'{"max_seq_lengths": [131072]}\'')
    p.add_argument("--log-samples", action="store_true", help="also write every request and response")
    p.add_argument("--apply-chat-template", action="store_true", help="render prompts with the model's chat template")
    p.add_argument("--seed", type=int, default=0, help="lm-eval's seeds (Python, NumPy, torch, few-shot)")
    add_threads_argument(p)


def add_checkpoint_arguments(where: argparse._MutuallyExclusiveGroup, p: argparse.ArgumentParser) -> None:
    """--model (the checkpoint, one of the exclusive targets), --served-model-name, --api-key."""
    where.add_argument("--model", metavar="DIR",
                       help="no server: run this checkpoint folder (or shipped name) in this process")
    add_deprecated_alias(where, "--checkpoint", "--model", dest="model")
    p.add_argument("--served-model-name", help="the model name the endpoint serves (default: the first of /v1/models)")
    p.add_argument("--api-key", default=client_api_key(), help=CLIENT_API_KEY_HELP)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _target(args: argparse.Namespace):
    if args.model is not None:
        return _engine_target(args)
    if args.oracle is not None:
        # lazy: a target (httpx, PIL, tiktoken) loads for its run, not for `k3ray --help`
        from k3ray.evals.oracle import OracleTarget

        return OracleTarget(wrong=args.oracle == "wrong")
    # lazy: a target (httpx, PIL, tiktoken) loads for its run, not for `k3ray --help`
    from k3ray.evals.lm_eval_bridge import probe_server
    from k3ray.evals.openai_target import OpenAITarget

    name = args.served_model_name or probe_server(args.endpoint, api_key=args.api_key).model
    return OpenAITarget(args.endpoint, name, api_key=args.api_key, timeout=args.timeout,
                        chat_template_kwargs=getattr(args, "chat_template_kwargs", None))


def _engine_target(args: argparse.Namespace):
    # lazy: torch and the engine only for --model
    import torch

    from k3ray.engine import LLM
    from k3ray.evals.engine_target import EngineTarget
    if args.cache_memory_mb <= 0:
        raise ValueError(f"--cache-memory-mb must be > 0, got {args.cache_memory_mb}")
    set_threads(args.threads)
    options = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = LLM(args.model, tokenizer=args.tokenizer, max_num_batched_tokens=args.max_num_batched_tokens,
              cache_memory_bytes=int(args.cache_memory_mb * 1024**2), device=args.device,
              dtype=getattr(torch, args.dtype), enforce_eager=args.enforce_eager, **options)
    return EngineTarget(llm, chat_template_kwargs=getattr(args, "chat_template_kwargs", None))


def lm_eval_main(args: argparse.Namespace) -> int:
    # lazy: lm-eval (the eval extra) only for `k3ray eval lm-eval`
    from lm_eval.utils import make_table

    from k3ray.evals import lm_eval_bridge as bridge

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        metadata = json.loads(args.metadata)
    except json.JSONDecodeError as e:
        raise ValueError(f"--metadata must be a JSON object, got {args.metadata!r}: {e}") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"--metadata must be a JSON object, got {args.metadata!r}")
    if args.endpoint is not None:
        info = bridge.probe_server(args.endpoint, args.served_model_name, args.api_key)
        model, model_args = "local-completions", bridge.local_completions_args(
            info, max_length=args.max_model_len, num_concurrent=args.concurrency, timeout=args.timeout,
            max_retries=args.max_retries, api_key=args.api_key)
        if not info.remote_tokenizer:
            print(f"k3ray eval: {info.root} has no /tokenizer_info + /tokenize: text prompts, no tokenizer "
                  "(loglikelihood tasks cannot run)", file=sys.stderr)
    else:
        set_threads(args.threads)
        model, model_args = "k3ray", {"pretrained": args.model}
        if args.max_model_len is not None:
            model_args["max_length"] = args.max_model_len
    results, path = bridge.run_lm_eval(
        tasks, model, model_args, out_dir=args.out, include_path=args.include_path, limit=args.limit,
        metadata=metadata, log_samples=args.log_samples, apply_chat_template=args.apply_chat_template,
        seed=args.seed)
    print(make_table(results))
    if path is not None:
        print(f"results in {path}")
    return 0


def main(args: argparse.Namespace) -> int:
    require_eval_extra()
    if args.suite == "lm-eval":
        return lm_eval_main(args)
    # lazy: httpx, numpy, PIL and tqdm load for the run, not for `k3ray --help`
    from k3ray.evals.openai_target import EndpointError
    from k3ray.evals.runner import RunConfig, run_eval
    from k3ray.evals.tasks import SUITES

    tasks = tuple(t.strip() for spec in args.tasks for t in spec.split(",") if t.strip())
    if not tasks and not args.task_file:
        tasks = SUITES[args.suite]
    config = RunConfig(
        tasks=tasks,
        lengths=parse_lengths(args.lengths),
        depths=parse_depths(args.depths),
        samples=args.samples,
        seed=args.seed,
        concurrency=args.concurrency,
        reserve_generation=args.reserve_generation,
        haystack=args.haystack,
        task_files=tuple(args.task_file),
        executor="threads" if args.model is not None else args.executor,  # the engine lives here
        template=args.template,
        chat=args.chat,
    )
    try:
        summary = run_eval(config, _target(args), args.out, resume=args.resume, progress=not args.no_progress)
    except EndpointError as e:
        print(f"k3ray eval: error: {e}", file=sys.stderr)
        return 2
    accuracy = "-" if summary["accuracy"] is None else f"{100 * summary['accuracy']:.1f}%"
    failed = f"{summary['errors']} failed" + (" (errors in results.jsonl)" if summary["errors"] else "")
    print(f"accuracy {accuracy} over {summary['n']} items in {summary['cells']} cells, {failed}; report in {args.out}")
    return 0 if summary["errors"] == 0 else 1
