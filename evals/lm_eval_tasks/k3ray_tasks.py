"""Datasets and scoring for k3ray's offline lm-eval tasks (loaded by the YAMLs beside this file
through lm-eval's `!function`; this folder is package data, not a package).

Every loader goes through `datasets` and reads only files shipped with k3ray. lm-eval calls a
`custom_dataset` as fn(**task metadata, **dataset_kwargs): the metadata holds the model_args
(`base_url`, `model`, `pretrained`, ...) and `--metadata`, so extra keys are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import datasets

from k3ray.default_model import checkpoint_dir
from k3ray.evals.haystack import corpus_path
from k3ray.evals.openai_target import OpenAITarget
from k3ray.evals.scoring import score
from k3ray.evals.tasks import get_task
from k3ray.evals.tasks.base import Cell
from k3ray.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parent
NIAH_DEFAULT_LENGTHS = (4096,)
NIAH_DEFAULT_DEPTHS = (0.0, 50.0, 100.0)
NIAH_MAX_GEN_TOKS = 32  # k3ray_niah.yaml's max_gen_toks: the answer is a 7-digit number


def jsonl_dataset(data_file: str, **_) -> datasets.DatasetDict:
    """A JSONL file (relative to this folder, or absolute) as the `test` split."""
    path = Path(data_file)
    path = path if path.is_absolute() else HERE / path
    if not path.is_file():
        raise ValueError(f"data_file {str(path)!r} does not exist")
    return datasets.load_dataset("json", data_files={"test": str(path)})


def kjv_chapters(num_docs: int = 2, **_) -> datasets.DatasetDict:
    """The first `num_docs` chapters of the bundled public-domain haystack corpus, for perplexity."""
    if int(num_docs) < 1:
        raise ValueError(f"num_docs must be >= 1, got {num_docs}")
    rows = datasets.load_dataset("json", data_files={"test": str(corpus_path())})
    return datasets.DatasetDict({"test": rows["test"].select(range(int(num_docs)))})


class _TokenCounter:
    """The part of a `Target` a text task needs to size a prompt: tokenize."""

    def __init__(self, tokenizer, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.max_context = None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allow_special=True)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def _server_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    for suffix in ("/v1/completions", "/v1/chat/completions", "/v1"):
        if root.endswith(suffix):
            return root[: -len(suffix)]
    return root


def counting_target(base_url: str | None = None, model: str | None = None, pretrained: str | None = None,
                    tokenizer: str | None = None):
    """Who counts tokens for the NIAH prompts: the server's /tokenize (base_url), the tokenizer of
    a checkpoint (pretrained / tokenizer directory), or else the byte-level default."""
    if base_url:
        if not model:
            raise ValueError("k3ray_niah needs the served model name (model=...) next to base_url")
        return OpenAITarget(_server_root(base_url), model)
    directory = tokenizer or checkpoint_dir(pretrained)  # a name (shipped, the default's) or a folder
    return _TokenCounter(load_tokenizer(str(directory)), str(directory))


def niah_dataset(max_seq_lengths=NIAH_DEFAULT_LENGTHS, depths=NIAH_DEFAULT_DEPTHS, samples: int = 1,
                 seed: int = 0, base_url: str | None = None, model: str | None = None, pretrained: str | None = None,
                 tokenizer: str | None = None, **_) -> datasets.DatasetDict:
    """k3ray's NIAH grid (lengths x depths x samples) as lm-eval docs. Each prompt plus the
    generated tokens is exactly `length` tokens of the model's tokenizer (RULER's convention)."""
    lengths = [max_seq_lengths] if isinstance(max_seq_lengths, int) else list(max_seq_lengths)
    depth_list = [depths] if isinstance(depths, (int, float)) else list(depths)
    if not lengths or any(int(n) <= NIAH_MAX_GEN_TOKS for n in lengths):
        raise ValueError(f"max_seq_lengths must be lengths above {NIAH_MAX_GEN_TOKS} tokens, got {max_seq_lengths}")
    if not depth_list or any(not 0 <= float(d) <= 100 for d in depth_list):
        raise ValueError(f"depths must be percentages in [0, 100], got {depths}")
    task = dataclasses.replace(get_task("niah"), max_tokens=NIAH_MAX_GEN_TOKS)
    target = counting_target(base_url, model, pretrained, tokenizer)
    docs = []
    for length in lengths:
        for depth in depth_list:
            for sample in range(int(samples)):
                cell = Cell("niah", int(length), float(depth), sample)
                item = task.build(cell, target, int(seed), reserve_generation=True)
                docs.append({"prompt": item.prompt, "answers": list(item.answers), "length": int(length),
                             "depth": float(depth), "sample": sample})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def niah_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's string_match_all: the fraction of the needle values found in the answer."""
    return {"string_match": score(results[0], doc["answers"], "all")}
