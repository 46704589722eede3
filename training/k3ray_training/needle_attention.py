"""Where each MLA head looks while a model copies a needle, by context length:
`python -m k3ray_training.needle_attention --lengths 8k,32k,256k --depth 50 --needle 4997477`.

Teacher-forced: a niah prompt of each length with its true answer appended, prefilled once by the engine.
At each row that writes an answer digit, per MLA layer and head: the attention mass on the needle's
digits, where the row looks most (relative to the needle's first digit), and the logit of the digit it
should copy minus the log-sum-exp of the haystack's. Softmax dilution alone lowers that gap by ln(N2/N1)
from length N1 to N2 (1.4 from 8K to 32K); a larger fall means the query or the key has drifted.

Measured on k3-tiny-niah (bf16, needle 4997477 at depth 50%, seed 0), the first MLA layer's head 0 at the
row writing the fifth digit: gap 15.1 at 8K, 12.5 at 32K, -2.6 at 256K (needle logit 23.9 -> 23.3 ->
12.3, query norm 12.9 -> 12.8 -> 11.6), where it looks at the seventh digit instead; `k3ray eval` on that
256K cell answers "4997". In 8K prompts cut from three places of the corpus that gap stays 14.4-15.3, so it is
the length, not the haystack's text: the KDA layers under that head write features that drift past the
8K tokens the model was trained on.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass

import torch

from k3ray.engine import LLM, SamplingParams
from k3ray.evals.cli import parse_lengths
from k3ray.evals.tasks import get_task
from k3ray.evals.tasks.base import Cell, cell_rng
from k3ray.models.mla import GatedMLA

PROMPT_MARGIN = 400  # characters left for the head and the question when sizing the haystack


@dataclass(frozen=True)
class HeadReading:
    layer: int  # 1-based decoder layer
    head: int
    needle_mass: list[float]  # per answer digit: attention on the needle's digits
    looks_at: list[int]  # per answer digit: argmax position minus the needle's first digit
    gap: list[float]  # per answer digit: its needle digit's logit minus the haystack's log-sum-exp


@dataclass(frozen=True)
class Prompt:
    text: str  # the prompt and its answer, teacher-forced
    answer: str
    needle_char: int  # character offset of the needle's first digit in text


def needle_prompt(length: int, depth: float, seed: int, needle: str | None) -> Prompt:
    """A niah prompt of about `length` byte tokens (the cell `k3ray eval` builds for that seed),
    its needle value replaced by `needle` if given, followed by its answer."""
    cell = Cell("niah", length, depth, 0)
    layout = get_task("niah").layout(cell_rng(seed, cell), cell, lambda s: len(s.encode()) + 1, length)
    text, answer = layout.render(length - PROMPT_MARGIN), layout.answers[0]
    if needle is not None:
        if not needle.isdigit():
            raise ValueError(f"--needle must be digits, got {needle!r}")
        text, answer = text.replace(answer, needle), needle
    marker = f"is: {answer}."
    return Prompt(f"{text} {answer}", answer, text.index(marker) + len("is: "))


def capture_mla_inputs(llm, text: str) -> tuple[list[int], dict[GatedMLA, torch.Tensor]]:
    """Prefill `text` once; each MLA layer's input rows [T, D] in position order."""
    model = llm.engine.executor.model
    layers = [m for m in model.modules() if isinstance(m, GatedMLA)]
    seen: dict[GatedMLA, list[tuple[torch.Tensor, torch.Tensor]]] = {m: [] for m in layers}

    def keep(module, args):
        seen[module].append((args[0].detach().float().cpu(), args[1].positions.detach().cpu()))

    hooks = [m.register_forward_pre_hook(keep) for m in layers]
    try:
        out = llm.generate([text], SamplingParams(temperature=0, max_tokens=1))[0]
    finally:
        for h in hooks:
            h.remove()
    inputs = {}
    for m, parts in seen.items():
        x, pos = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        inputs[m] = x[torch.argsort(pos)]  # [T, D]
    return out.prompt_token_ids, inputs


@torch.no_grad()
def read_heads(layer: GatedMLA, x: torch.Tensor, needle: int, rows: torch.Tensor) -> list[HeadReading]:
    """x [T, D] the layer's inputs; needle: the position of the needle's first digit; rows [R]: the
    rows writing answer digits 0..R-1 (row j should copy position needle + j)."""
    layer = copy.deepcopy(layer).float().cpu()  # Module.float() converts in place: leave the engine's layer as it is
    k, _ = layer.expand_kv(layer.project_latent(x))  # [T, H, Dqk]
    q = layer.project_q(x[rows])  # [R, H, Dqk]
    logits = torch.einsum("rhd,thd->hrt", q, k) * layer.scale  # [H, R, T]
    T, R = x.shape[0], len(rows)
    causal = torch.arange(T)[None, :] <= rows[:, None]  # [R, T]
    logits = logits.masked_fill(~causal, float("-inf"))
    haystack = torch.ones(T, dtype=torch.bool)
    haystack[max(0, needle - 64): needle + R + 2] = False  # the needle sentence
    haystack[int(rows[0]) - 200:] = False  # the question and the answer
    digits = needle + torch.arange(R)
    readings = []
    for h in range(layer.num_heads):
        p = logits[h].softmax(-1)  # [R, T]
        hay_lse = logits[h][:, haystack].logsumexp(-1)  # [R]
        target = logits[h][torch.arange(R), digits]  # [R]
        readings.append(HeadReading(
            layer=layer.layer_idx + 1, head=h,
            needle_mass=[round(v, 4) for v in p[:, needle: needle + R].sum(-1).tolist()],
            looks_at=[int(t) - needle for t in p.argmax(-1)],
            gap=[round(v, 2) for v in (target - hay_lse).tolist()],
        ))
    return readings


def measure(llm, prompt: Prompt) -> dict:
    ids, inputs = capture_mla_inputs(llm, prompt.text)
    leading = len(ids) - len(prompt.text.encode())  # special tokens before the text (byte tokenizer)
    needle = leading + len(prompt.text[: prompt.needle_char].encode())
    rows = torch.arange(len(ids) - len(prompt.answer) - 1, len(ids) - 1)
    assert bytes(ids[needle: needle + len(prompt.answer)]).decode() == prompt.answer
    heads = [asdict(r) for m, x in inputs.items() for r in read_heads(m, x, needle, rows)]
    return {"prompt_tokens": len(ids), "answer": prompt.answer, "needle_position": needle, "heads": heads}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3ray_training.needle_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="k3-tiny-niah", help="a shipped name or checkpoint directory")
    p.add_argument("--lengths", default="8k", help="prompt lengths in tokens, e.g. 8k,32k,256k")
    p.add_argument("--depth", type=float, default=50.0, help="needle depth in percent")
    p.add_argument("--needle", default=None, help="the needle's value at every length (default: the cell's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the readings here")
    args = p.parse_args(argv)
    if not 0 <= args.depth <= 100:
        p.error(f"--depth must be in [0, 100], got {args.depth}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = []
    for length in parse_lengths(args.lengths):
        prompt = needle_prompt(length, args.depth, args.seed, args.needle)
        llm = LLM(args.model, dtype=getattr(torch, args.dtype), enable_prefix_caching=False,
                  max_model_len=len(prompt.text.encode()) + 8, device="cpu")
        reading = measure(llm, prompt)
        report.append({"length": length, "depth": args.depth, **reading})
        print(f"{reading['prompt_tokens']} tokens, needle {prompt.answer} at {reading['needle_position']}")
        for r in reading["heads"]:
            print(f"  layer {r['layer']} head {r['head']}: mass {r['needle_mass']} gap {r['gap']} at {r['looks_at']}")
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
