"""Write items of any item kind (a paraphrase family's included) as a `k3ray eval --task-file` JSONL,
so a checkpoint's score on a wording the eval does not name (the held-out family) is measured by
the real eval, through completions or chat:

    python -m k3ray_training.task_file --kinds niah@para_quiz,niah@para_quiz+chat --haystack 1700 \\
        --samples 30 --out runs/heldout-2k.jsonl
    k3ray eval ruler --model DIR --tasks niah --lengths 1k --task-file runs/heldout-2k.jsonl --out runs/heldout

A raw kind's row is the prompt up to its answer prefix (`input`) and the prefix (`answer_prefix`);
a chat kind's `input` is the whole prompt as one user message, which the eval sends to the chat
route. `length` is the prompt's size in bytes (the byte tokenizer's tokens); the seed is fixed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from k3ray_training.data import ItemKind, worded_prompt
from k3ray_training.wordings import answer_prefix_at


def task_rows(kind: ItemKind, haystack: int, samples: int, seed: int) -> list[dict]:
    rng = random.Random(f"task-file:{seed}:{kind.name}:{haystack}")
    rows = []
    for _ in range(samples):
        prompt, answers, _ = worded_prompt(kind, haystack, rng)
        row = {"outputs": list(answers), "length": len(prompt.encode("utf-8")), "max_tokens": 128}
        if kind.chat:
            row["input"] = [{"role": "user", "content": prompt}]
        else:
            cut = answer_prefix_at(prompt)
            row |= {"input": prompt[:cut], "answer_prefix": prompt[cut:]}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m k3ray_training.task_file", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", required=True, help="item kinds, comma-separated, e.g. niah@para_quiz,niah@ruler+chat")
    p.add_argument("--haystack", type=int, default=1700, help="haystack characters per item (1700: a 2K prompt)")
    p.add_argument("--samples", type=int, default=30, help="items per kind")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSONL file to write")
    args = p.parse_args(argv)
    if args.samples < 1 or args.haystack < 1:
        raise SystemExit("--samples and --haystack must be >= 1")
    try:
        kinds = [ItemKind.parse(k.strip()) for k in args.kinds.split(",") if k.strip()]
    except ValueError as e:
        raise SystemExit(f"--kinds: {e}") from None
    if not kinds or not all(k.templated for k in kinds):
        raise SystemExit("--kinds names eval tasks in a wording or as chat (task@wording[+chat])")
    rows = [row for kind in kinds for row in task_rows(kind, args.haystack, args.samples, args.seed)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} items in {out}")


if __name__ == "__main__":
    main()
