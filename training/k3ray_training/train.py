"""Train k3-tiny-niah: `cd training && python -m k3ray_training.train --out runs/niah [--export DIR]`.

Seeded (the data of step s depends only on (seed, s)), resumable (rerun the same command: it
continues from `OUT/train_state.pt`), logging loss and a held-out teacher-forced exact match to
`OUT/train_log.jsonl` (its paths relative to the folder that holds OUT); `--export` writes the
K3-format checkpoint (bf16, MXFP4 experts) with the tokenizer when the run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

# on a shared CPU, spinning OpenMP workers wait for descheduled peers: a 10x slowdown measured here
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after the OpenMP setting
import torch.nn.functional as F
from tqdm import tqdm

from k3ray.config import k3_tiny_config
from k3ray.device import resolve_device
from k3ray.device_flags import DEVICE_CHOICES
from k3ray.evals.haystack import load_corpus
from k3ray.tokenizer import ByteTokenizer

from k3ray_training import data
from k3ray_training.data import Example, heldout_set, sample_example, step_haystack
from k3ray_training.export import export_checkpoint
from k3ray_training.init_weights import initial_weights
from k3ray_training.model import (GATHER_HEAD, SELF_HEAD, CopySupervision, KdaCarry, amplify_mla_head,
                                  balance_experts, cosine_lr, niah_config, parameter_count, train_logits, trainable_model)
from k3ray_training.state_bank import Chain, StateBank, initial_states

STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.jsonl"
CONFIGS = {"niah": niah_config, "tiny": lambda: k3_tiny_config().replace(vision=None)}
HELDOUT_TASKS = ("niah", "niah_multikey_1", "vt", "recall")
HELDOUT_HAYSTACKS = (700, 1700)  # about 1K- and 2K-token prompts
BALANCE_RATE = 1e-3
PAD_SLACK = 1.25  # a micro-batch's padded tokens may exceed its real ones by this factor
PATH_ARGS = ("out", "init_from", "export")  # logged relative to the folder holding the run


# flag -> what its weighted loss asks (all but --copy-attention need --gather-attention's key spans)
AUXILIARY_LOSSES = {
    "--copy-attention": "asking head 0 of each MLA layer to attend, from each row that writes a number the prompt "
                        "holds, to that digit's first occurrence",
    "--gather-attention": "asking the gathering MLA layer's head 1 to attend evenly to the key of each number a "
                          "lead digit copies, at that number and at the question (copy supervision then skips "
                          "that layer)",
    "--fingerprint-contrast": "asking the gathered key at each question to be nearest the gathered key of its own "
                              "number",
    "--match-contrast": "asking the next MLA layer's head 0 to score each question's own number above the "
                        "micro-batch's other numbers",
    "--route-partial": "keeping two AttnRes weights between 0.5 and 0.9: the matching MLA layer's input on the "
                       "source holding the gathering layer's output (at numbers and questions), and the output's "
                       "on the source holding the matching layer's (at questions)",
    "--self-read": "asking the gathering MLA layer's head 2 to read each number's own row, so its digit shares an "
                   "AttnRes source with the gathered key",
    "--answer-readout": "asking the matching MLA layer's head 0, through its own share of the logits at each "
                        "question's answer row (its AttnRes weight, the final norm, the LM head), to name the "
                        "asked number's first digit",
    "--value-readout": "asking the matching MLA layer's head 0 value at each asked number's first digit, as that "
                       "head's share of the answer row's logits were it to read only that row, to name the digit",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3ray_training.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (state, log); rerun to resume")
    p.add_argument("--export", default=None, help="write the checkpoint here when the run stops")
    p.add_argument("--config", choices=sorted(CONFIGS), default="niah")
    p.add_argument("--init-from", default=None,
                   help="start from the weights of another run's train_state.pt or of a K3-format checkpoint "
                        "(a directory, or a shipped name: k3-tiny-niah)")
    p.add_argument("--tasks", default=None, help="task mix as name=share,... (default: data.TASK_MIX)")
    p.add_argument("--steps", type=int, default=480, help="the schedule's length (curriculum, learning rate)")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and save) after this step; rerun to go on")
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lm-weight", type=float, default=0.0,
                   help="weight of a next-token loss on the prompt tokens beside the answer loss (0: answers only)")
    for flag, text in AUXILIARY_LOSSES.items():
        p.add_argument(flag, type=float, default=0.0, help=f"weight of a loss {text} (0: off)")
    p.add_argument("--copy-rows", choices=("all", "lead"), default="all",
                   help="the rows --copy-attention supervises: every digit of a copied number, or only its "
                        "first (lead) digit, the one whose row must match the asked key")
    p.add_argument("--gather-gain", type=float, default=1.0,
                   help="at the start of a run, scale the gathering MLA layer's head-1 output projection by this "
                        "(the gathered key is small beside the MoE outputs that share its AttnRes source)")
    p.add_argument("--match-gain", type=float, default=1.0,
                   help="at the start of a run, scale the matching MLA layer's head-0 output projection by this "
                        "(its answer, small beside the MoE outputs at the answer rows, then reaches the logits)")
    p.add_argument("--lookup-digits", type=int, default=1,
                   help="how many leading digits of each copied number the key-lookup losses (--gather-attention "
                        "and those after it) supervise: the first picks the needle; the second, whose previous "
                        "digit recurs in other needles, must pick it again")
    p.add_argument("--gather-layer", type=int, default=1,
                   help="which MLA layer (1-based) gathers with --gather-attention; the match is the next one")
    p.add_argument("--freeze", action="append", default=[], metavar="REGEX",
                   help="keep the parameters whose names match as they are (repeatable), e.g. the layers "
                        "below a head whose values must not drift")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--max-haystack", type=int, default=3700, help="cap on haystack characters per item")
    p.add_argument("--haystacks", default=None,
                   help="a fixed mix of haystack sizes in characters as size=share,... in place of the length "
                        "curriculum (for a stage that starts from trained weights)")
    p.add_argument("--carry-state", type=float, default=0.0, metavar="P",
                   help="share of items that start from KDA states aged on long essay haystacks (0: every item "
                        "starts at zeros): short items then see the states of a long context")
    p.add_argument("--carry-chains", type=int, default=2, help="how many aged states there are")
    p.add_argument("--carry-age", type=int, default=8192, help="haystack tokens each aged state reads every step")
    p.add_argument("--carry-start-age", type=int, default=0,
                   help="haystack tokens the aged states read before the first step (in --carry-age pieces)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--heldout-per-cell", type=int, default=2)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="auto", metavar="{" + ",".join(DEVICE_CHOICES) + "}",
                   help="where the model trains (auto: CUDA when available); the checkpoint is exported from the CPU")
    args = p.parse_args(argv)
    for name in ("steps", "tokens_per_step", "eval_every", "save_every", "heldout_per_cell", "lookup_digits",
                 "carry_chains", "carry_age"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.carry_state <= 1.0:
        raise SystemExit(f"--carry-state is a probability, got {args.carry_state}")
    args.task_mix = data.TASK_MIX if args.tasks is None else parse_task_mix(args.tasks)
    args.haystack_mix = None if args.haystacks is None else parse_haystack_mix(args.haystacks)
    return args


def parse_shares(text: str, flag: str, example: str) -> dict[str, float]:
    shares = {}
    for part in filter(None, text.split(",")):
        name, _, share = part.partition("=")
        try:
            shares[name.strip()] = float(share) if share else 1.0
        except ValueError:
            raise SystemExit(f"--{flag} entries look like {example}, got {part!r}") from None
    if not shares or min(shares.values()) <= 0:
        raise SystemExit(f"--{flag} needs positive shares, got {text!r}")
    return shares


def parse_haystack_mix(text: str) -> dict[int, float]:
    shares = parse_shares(text, "haystacks", "1700=0.5")
    if not all(size.isdigit() and int(size) > 0 for size in shares):
        raise SystemExit(f"--haystacks sizes are positive character counts, got {text!r}")
    return {int(size): share for size, share in shares.items()}


def parse_task_mix(text: str) -> dict[str, float]:
    mix = parse_shares(text, "tasks", "niah=0.5")
    unknown = sorted(set(mix) - set(data.TASK_MIX) - set(data.BOOTSTRAP_TASKS))
    if unknown:
        raise SystemExit(f"--tasks names unknown tasks {unknown}; known: {', '.join(data.TASK_MIX)}")
    return mix


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, T] right-padded prompt + answer
    rows: torch.Tensor  # [R] flat positions predicting an answer token, then each item's labelled prompt positions
    labels: torch.Tensor  # [R]
    tasks: tuple[str, ...]  # [R] the task of each row


def batch_tensors(examples: list[Example], pad_id: int, prompt_labels: bool = True) -> Batch:
    seqs = [e.prompt + e.answer for e in examples]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    rows, labels, tasks = [], [], []
    for b, (e, s) in enumerate(zip(examples, seqs)):
        ids[b, : len(s)] = torch.tensor(s)
        start = b * T + len(e.prompt) - 1
        rows += range(start, start + len(e.answer))
        labels += e.answer
        tasks += [e.task] * len(e.answer)
    if prompt_labels:
        for b, e in enumerate(examples):
            rows += [b * T + p for p in e.prompt_labels]
            labels += [e.prompt[p + 1] for p in e.prompt_labels]
            tasks += [e.task] * len(e.prompt_labels)
    return Batch(ids, torch.tensor(rows), torch.tensor(labels), tuple(tasks))


def task_losses(losses: torch.Tensor, tasks: tuple[str, ...]) -> dict[str, float]:
    """Per-row losses [R] -> the mean loss of each task in the batch."""
    by_task: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        by_task.setdefault(task, []).append(i)
    return {t: round(losses[idx].mean().item(), 4) for t, idx in sorted(by_task.items())}


def lead_digit_rows(batch: Batch, digit_ids: torch.Tensor) -> torch.Tensor:
    """[R] bool: rows predicting a number's first digit, where a needle item picks its needle (the
    later digits follow the one picked): the label is a digit and the token read is not."""
    read = batch.ids.flatten()[batch.rows]
    return torch.isin(batch.labels, digit_ids) & ~torch.isin(read, digit_ids)


def prompt_targets(examples: list[Example], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> rows [P] (flat positions inside each prompt), labels [P]: the next prompt token."""
    rows, labels = [], []
    for b, e in enumerate(examples):
        rows += range(b * width, b * width + len(e.prompt) - 1)
        labels += e.prompt[1:]
    return torch.tensor(rows), torch.tensor(labels)


def copy_targets(example: Example, digit_ids: set[int], first: int | None = None) -> list[tuple[int, int]]:
    """(row, source) sequence positions: each trained row that predicts a digit of a number the prompt
    already holds, and where that digit sits in the number's first occurrence (the stored pair or needle
    a retrieval head should read). first=N keeps each number's first N digits (first=1: the row that
    must match the key, where the later digits only step along the number); None keeps them all."""
    rows = [(len(example.prompt) - 1 + j, tok) for j, tok in enumerate(example.answer)]
    rows += [(p, example.prompt[p + 1]) for p in example.prompt_labels]
    runs: list[list[tuple[int, int]]] = []
    for pos, tok in sorted(rows):
        if tok not in digit_ids:
            continue
        if runs and runs[-1][-1][0] == pos - 1:
            runs[-1].append((pos, tok))
        else:
            runs.append([(pos, tok)])
    seq = example.prompt
    pairs = []
    for run in runs:
        digits, start = [tok for _, tok in run], run[0][0]
        n = len(digits)
        source = next((s for s in range(start - n + 1) if seq[s : s + n] == digits), None)
        if source is not None:  # a source ending before the row that first reads it
            pairs += [(pos, source + i) for i, (pos, _) in enumerate(run[:first])]
    return pairs


# the key a stored number belongs to: "for brave-lantern is: 4812093", "kzt: 0731562" (bytes before the value)
_KEY_BEFORE_VALUE = re.compile(rb"([^\s:,.]+)(?: is)?: ?$")
KEY_SEARCH_BYTES = 64  # a key and its separator end within this many bytes before the value


def gather_targets(example: Example, pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(row, start, end) sequence positions: for each (row, source) lead-digit copy pair, the stored
    number's key span [start, end) gathered at its first digit (source), and the same key's last
    occurrence between the number and the row (the question's key) gathered at the row."""
    seq = example.prompt + example.answer
    text = bytes(t if t < 256 else 0 for t in seq)  # byte ids are the bytes; specials never match a key
    spans = []
    for row, source in pairs:
        start = source  # the number's first digit: a later digit's key is the number's
        while start > 0 and text[start - 1:start].isdigit():
            start -= 1
        found = _KEY_BEFORE_VALUE.search(text, max(0, start - KEY_SEARCH_BYTES), start)
        if found is None:
            continue
        key = found.group(1)
        asked = text.rfind(key, source, row + 1)
        if asked >= 0:
            spans += [(source, found.start(1), found.end(1)), (row, asked, asked + len(key))]
    return spans


def length_groups(examples: list[Example], slack: float = PAD_SLACK) -> list[list[Example]]:
    """The step's items by length, cut into micro-batches whose padded size stays within `slack` x
    their tokens (one [B, T] batch pads every item to the longest: a 2.5K-token needles_wide item
    beside five 400-token recall items made 15K padded tokens of 4.5K)."""
    order = sorted(examples, key=lambda e: len(e.prompt) + len(e.answer))
    groups: list[list[Example]] = []
    tokens = 0
    for e in order:
        n = len(e.prompt) + len(e.answer)  # the longest so far: the group's width if it joins
        if groups and (len(groups[-1]) + 1) * n <= slack * (tokens + n):
            groups[-1].append(e)
            tokens += n
        else:
            groups.append([e])
            tokens = n
    return groups


@dataclass(frozen=True)
class StepLosses:
    loss: float  # mean over the answer (and labelled prompt) rows of the whole step
    lm_loss: float  # mean next-token loss over the prompts (0 without --lm-weight)
    copy_loss: float  # mean over copy rows and MLA layers of -log attention on the source (0 without --copy-attention)
    gather_loss: float  # mean over gather rows of KL(uniform on the key span || attention) (0 without --gather-attention)
    contrast_loss: float  # mean over questions of -log p(own key) among the gathered numbers (0 without --fingerprint-contrast)
    match_loss: float  # the same under the second MLA layer's head-0 scores (0 without --match-contrast)
    row_losses: torch.Tensor  # [R] each row's loss, micro-batch after micro-batch
    tasks: tuple[str, ...]  # [R]
    lead: torch.Tensor  # [R] bool: rows predicting a number's first digit
    shapes: tuple[tuple[int, int], ...]  # each micro-batch's [B, T]
    route_loss: float = 0.0  # the route losses (input and output AttnRes out of ROUTE_BAND) over the gather rows
    self_loss: float = 0.0  # mean over numbers of -log(the gathering layer's SELF_HEAD weight on the number's own row)
    readout_loss: float = 0.0  # mean over questions of the matching head's logit share's cross-entropy on the lead digit
    value_loss: float = 0.0  # the same for the head's value at the asked number (--value-readout)


def accumulate_step(model, examples: list[Example], pad_id: int, lm_weight: float, digit_ids: torch.Tensor,
                    loads: dict[int, torch.Tensor] | None = None, slack: float = PAD_SLACK,
                    copy_weight: float = 0.0, copy_first: int | None = None, lookup_digits: int = 1,
                    gather_weight: float = 0.0, contrast_weight: float = 0.0, match_weight: float = 0.0,
                    gather_layer: int = 1, route_weight: float = 0.0, self_weight: float = 0.0,
                    readout_weight: float = 0.0, value_weight: float = 0.0,
                    starts: list[Chain | None] | None = None) -> StepLosses:
    """Backward of mean(row losses) + lm_weight * mean(prompt next-token losses) + copy_weight *
    mean(copy-attention losses) + gather_weight * mean(key-gather attention losses) + contrast_weight *
    mean(fingerprint contrast losses, within each micro-batch) + match_weight * mean(second-layer match
    losses, within each micro-batch) + route_weight * (input and output AttnRes route losses) / gather rows +
    self_weight * mean(self-read losses) + readout_weight * mean(answer readout losses) + value_weight * mean(value
    readout losses) over all the step's items, one length group
    at a time: the gradient of the whole batch without its padding (the contrast's negatives are the
    micro-batch's other numbers, so that term alone depends on the grouping). With starts, item i's KDA
    layers start from the aged states starts[i] (None: zeros)."""
    device = next(model.parameters()).device
    start_of = {} if starts is None else {id(e): c for e, c in zip(examples, starts)}
    n_rows = sum(len(e.answer) + len(e.prompt_labels) for e in examples)
    n_lm = sum(len(e.prompt) - 1 for e in examples)
    digits = set(digit_ids.tolist())
    sources = {id(e): copy_targets(e, digits, copy_first) for e in examples} if copy_weight else {}
    spans = ({id(e): gather_targets(e, copy_targets(e, digits, first=lookup_digits)) for e in examples}
             if gather_weight else {})
    n_copy, n_gather = sum(map(len, sources.values())), sum(map(len, spans.values()))
    row_parts, tasks, leads, shapes = [], [], [], []
    # auxiliary loss -> (weight, the step's count its mean is over); each micro-batch adds its summed loss
    counts = {"copy": (copy_weight, n_copy), "gather": (gather_weight, n_gather),
              "contrast": (contrast_weight, n_gather / 2), "match": (match_weight, n_gather / 2),
              "route": (route_weight, n_gather), "self": (self_weight, n_gather / 2),
              "readout": (readout_weight, n_gather / 2), "value": (value_weight, n_gather / 2)}
    sums = dict.fromkeys(counts, 0.0)
    lm_sum = 0.0
    for group in length_groups(examples, slack):
        batch = batch_tensors(group, pad_id)
        R, T = len(batch.rows), batch.ids.shape[1]
        lm_rows, lm_labels = prompt_targets(group, T) if lm_weight else (batch.rows[:0], None)
        copy = None
        if n_copy or n_gather:
            flat = [(b * T + row, b * T + src) for b, e in enumerate(group) for row, src in sources.get(id(e), ())]
            copy = CopySupervision(*torch.tensor(flat, dtype=torch.long).reshape(-1, 2).T)
            if gather_weight:
                flat = [(b * T + row, b * T + start, b * T + end)
                        for b, e in enumerate(group) for row, start, end in spans[id(e)]]
                copy.gather_rows, copy.gather_starts, copy.gather_ends = torch.tensor(flat, dtype=torch.long).reshape(-1, 3).T
                copy.contrast, copy.match, copy.gather_layer = contrast_weight > 0, match_weight > 0, gather_layer
                copy.route, copy.self_read, copy.readout = route_weight > 0, self_weight > 0, readout_weight > 0
                copy.value_readout = value_weight > 0
                if contrast_weight or match_weight:
                    keys = [tuple(batch.ids.flatten()[start:end].tolist()) for _, start, end in flat[0::2]]
                    names = {key: i for i, key in enumerate(dict.fromkeys(keys))}
                    copy.gather_key_ids = torch.tensor([names[key] for key in keys], dtype=torch.long)
        if copy is not None:
            copy = copy_to(copy, device)
        carry = None
        if starts is not None:
            lengths = torch.tensor([len(e.prompt) + len(e.answer) for e in group])
            valid = torch.arange(T)[None] < lengths[:, None]  # [B, T]
            carry = KdaCarry(valid, initial_states([start_of[id(e)] for e in group], model))
        logits = train_logits(model, batch.ids.to(device), torch.cat([batch.rows, lm_rows]).to(device), loads, copy,
                              carry=carry)
        row_losses = F.cross_entropy(logits[:R], batch.labels.to(device), reduction="none")  # [R]
        part = row_losses.sum() / n_rows
        if lm_weight:
            lm_part = F.cross_entropy(logits[R:], lm_labels.to(device), reduction="sum")
            part = part + lm_weight * lm_part / n_lm
            lm_sum += lm_part.item()
        if copy is not None:
            parts = {"copy": torch.stack(copy.losses).mean() if copy.losses else None,  # mean over MLA layers
                     "gather": copy.gather_losses[0] if copy.gather_losses else None,  # one layer
                     "contrast": copy.contrast_losses[0] if copy.contrast_losses else None,
                     "match": copy.match_losses[0] if copy.match_losses else None,
                     "route": sum(copy.route_losses) if copy.route_losses else None,  # the input and the output
                     "self": copy.self_losses[0] if copy.self_losses else None,
                     "readout": copy.readout_losses[0] if copy.readout_losses else None,
                     "value": copy.value_losses[0] if copy.value_losses else None}
            for name, loss in parts.items():
                if loss is not None:
                    weight, count = counts[name]
                    part = part + weight * loss / count
                    sums[name] += loss.item()
        part.backward()
        row_parts.append(row_losses.detach().cpu())
        tasks += batch.tasks
        leads.append(lead_digit_rows(batch, digit_ids))
        shapes.append(tuple(batch.ids.shape))
    rows = torch.cat(row_parts)
    mean = {name: sums[name] / max(count, 1) for name, (_, count) in counts.items()}
    return StepLosses(rows.mean().item(), lm_sum / max(n_lm, 1), mean["copy"], mean["gather"], mean["contrast"],
                      mean["match"], rows, tuple(tasks), torch.cat(leads), tuple(shapes), mean["route"], mean["self"], mean["readout"],
                      mean["value"])


def copy_to(copy: CopySupervision, device: torch.device) -> CopySupervision:
    """The supervision's index tensors on the model's device (built on the CPU from the step's items)."""
    moved = {name: getattr(copy, name).to(device) for name in
             ("rows", "targets", "gather_rows", "gather_starts", "gather_ends", "gather_key_ids")
             if getattr(copy, name) is not None}
    return replace(copy, **moved)


def step_examples(args: argparse.Namespace, step: int, tokenizer: ByteTokenizer) -> list[Example]:
    rng = random.Random(f"train:{args.seed}:{step}")
    if args.haystack_mix:
        haystack = min(args.max_haystack, rng.choices(*zip(*args.haystack_mix.items()))[0])
    else:
        haystack = step_haystack(step, args.steps, rng, args.max_haystack)
    examples, tokens = [], 0
    while tokens < args.tokens_per_step:
        examples.append(sample_example(haystack, rng, tokenizer, args.task_mix))
        tokens += len(examples[-1].prompt) + len(examples[-1].answer)
    return examples


@torch.no_grad()
def heldout_scores(model, examples: list[Example], pad_id: int) -> dict[str, float]:
    """Teacher-forced exact match per task: every answer token (EOS included) is the argmax, which
    is what greedy decoding of the answer needs."""
    model.eval()
    device = next(model.parameters()).device
    hits: dict[str, list[float]] = {}
    for e in examples:
        batch = batch_tensors([e], pad_id, prompt_labels=False)
        pred = train_logits(model, batch.ids.to(device), batch.rows.to(device)).argmax(-1).cpu()
        hits.setdefault(e.task, []).append(float(bool((pred == batch.labels).all())))
    model.train()
    return {task: sum(v) / len(v) for task, v in hits.items()}


def freeze(model, patterns: list[str]) -> list[str]:
    """Stop training the parameters whose names match any of the regexes (re.match); -> their names."""
    names = []
    for name, p in model.named_parameters():
        if any(re.match(pat, name) for pat in patterns):
            p.requires_grad_(False)
            names.append(name)
    unmatched = [pat for pat in patterns if not any(re.match(pat, name) for name in names)]
    if unmatched:
        raise SystemExit(f"--freeze {unmatched} matches no parameter (names look like model.layers.3.self_attn.q_a_proj.weight)")
    return names


def apply_gains(model, args: argparse.Namespace) -> None:
    """--gather-gain on the gathering layer's GATHER_HEAD, --match-gain on the next MLA layer's head 0."""
    if args.gather_gain != 1.0:
        amplify_mla_head(model, args.gather_layer, args.gather_gain, head=GATHER_HEAD)
    if args.match_gain != 1.0:
        amplify_mla_head(model, args.gather_layer + 1, args.match_gain, head=0)


def save_state(path: Path, model, optimizer, step: int, bank: StateBank | None = None) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    if bank is not None:
        state["state_bank"] = bank.state_dict()
    torch.save(state, tmp)
    os.replace(tmp, path)


def logged_args(args: dict) -> dict:
    """A run's arguments as its log records them: the paths relative to the folder that holds the
    run (`out`'s parent), so a log names no machine's folders. A bare name (a shipped checkpoint's,
    `--init-from k3-tiny-niah`) stays as given."""
    base = os.path.dirname(os.path.abspath(args["out"]))
    logged = {k: v for k, v in args.items() if k not in ("task_mix", "haystack_mix")}
    for key in PATH_ARGS:
        value = logged.get(key)
        if value and os.sep in value:
            logged[key] = os.path.relpath(os.path.abspath(value), base)
    return logged


def resume_log(path: Path, step: int) -> None:
    """Drop log lines past the saved step (a run killed between saves repeats them)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in lines))


def train(args: argparse.Namespace) -> Path:
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise SystemExit(f"--device: {e}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[args.config]()
    mla_layers = sum(kind == "mla" for kind in config.layer_types)
    if not 1 <= args.gather_layer <= mla_layers:
        raise SystemExit(f"--gather-layer {args.gather_layer}: the {args.config} config has MLA layers 1 to {mla_layers}")
    if args.match_gain != 1.0 and args.gather_layer == mla_layers:
        raise SystemExit(f"--match-gain scales the MLA layer after --gather-layer {args.gather_layer}, the last")
    if args.self_read and config.mla_num_heads <= SELF_HEAD:
        raise SystemExit(f"--self-read asks MLA head {SELF_HEAD}; the {args.config} config has {config.mla_num_heads}")
    tokenizer = ByteTokenizer(config.vocab_size)
    model = trainable_model(config, args.seed).to(device)
    frozen = freeze(model, args.freeze)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    bank = StateBank(args.carry_chains, args.carry_state) if args.carry_state else None
    corpus = load_corpus() if bank is not None else ""
    start = 0
    state_path, log_path = out / STATE_FILE, out / LOG_FILE
    if args.init_from and not state_path.exists():
        initial_weights(model, args.init_from)
    if not state_path.exists():
        apply_gains(model, args)
    if state_path.exists():
        state = torch.load(state_path, weights_only=True, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        if bank is not None and "state_bank" in state:
            bank.load_state_dict(state["state_bank"])
    resume_log(log_path, start)
    heldout = heldout_set(HELDOUT_HAYSTACKS, HELDOUT_TASKS, args.heldout_per_cell, args.seed, tokenizer)
    pad = config.pad_token_id
    digit_ids = torch.tensor(tokenizer.encode("0123456789"))
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    bar = tqdm(range(start, stop), initial=start, total=args.steps, desc=f"train {config.name}",
               dynamic_ncols=True)
    began = time.time()
    last_score: dict[str, float] = {}
    with log_path.open("a") as log:
        log.write(json.dumps({"step": start, "event": "start", "params": parameter_count(model), "frozen": len(frozen),
                              "args": logged_args(vars(args)),
                              "task_mix": args.task_mix}) + "\n")
        for step in bar:
            lr = cosine_lr(step, args.steps, args.lr, args.warmup)
            for group in optimizer.param_groups:
                group["lr"] = lr
            examples = step_examples(args, step, tokenizer)
            starts = None
            if bank is not None:
                carry_rng = random.Random(f"carry:{args.seed}:{step}")
                while min(bank.ages()) < args.carry_start_age:  # the run's first step: age the states first
                    bank.age_on_text(model, corpus, carry_rng, args.carry_age, tokenizer.encode)
                bank.age_on_text(model, corpus, carry_rng, args.carry_age, tokenizer.encode)
                starts = [bank.draw(carry_rng) for _ in examples]
                ages = [c.age for c in starts if c is not None]
            loads: dict[int, torch.Tensor] = {}
            optimizer.zero_grad(set_to_none=True)
            step_losses = accumulate_step(model, examples, pad, args.lm_weight, digit_ids, loads,
                                          copy_weight=args.copy_attention,
                                          copy_first=1 if args.copy_rows == "lead" else None,
                                          lookup_digits=args.lookup_digits,
                                          gather_weight=args.gather_attention,
                                          contrast_weight=args.fingerprint_contrast,
                                          match_weight=args.match_contrast, gather_layer=args.gather_layer,
                                          route_weight=args.route_partial, self_weight=args.self_read,
                                          readout_weight=args.answer_readout, value_weight=args.value_readout,
                                          starts=starts)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            balance_experts(model, loads, BALANCE_RATE)
            done = step + 1
            record = {"step": done, "loss": round(step_losses.loss, 4), "lr": lr,
                      "batch": [list(shape) for shape in step_losses.shapes], "seconds": round(time.time() - began, 1),
                      "task_loss": task_losses(step_losses.row_losses, step_losses.tasks)}
            lead = step_losses.lead
            if lead.any():
                record["lead_digit_loss"] = task_losses(step_losses.row_losses[lead],
                                                        tuple(t for t, x in zip(step_losses.tasks, lead.tolist()) if x))
            if bank is not None:  # the items that started from carried states, and those states' ages in tokens
                record["carried"] = {"items": len(ages), "of": len(examples), "max_age": max(ages, default=0)}
            if args.lm_weight:
                record["lm_loss"] = round(step_losses.lm_loss, 4)
            if args.copy_attention:
                record["copy_attention_loss"] = round(step_losses.copy_loss, 4)
            if args.gather_attention:
                record["gather_attention_loss"] = round(step_losses.gather_loss, 4)
            if args.fingerprint_contrast:
                record["fingerprint_contrast_loss"] = round(step_losses.contrast_loss, 4)
            if args.match_contrast:
                record["match_contrast_loss"] = round(step_losses.match_loss, 4)
            if args.route_partial:
                record["route_partial_loss"] = round(step_losses.route_loss, 4)
            if args.self_read:
                record["self_read_loss"] = round(step_losses.self_loss, 4)
            if args.answer_readout:
                record["answer_readout_loss"] = round(step_losses.readout_loss, 4)
            if args.value_readout:
                record["value_readout_loss"] = round(step_losses.value_loss, 4)
            if done % args.eval_every == 0 or done == args.steps:
                last_score = heldout_scores(model, heldout, pad)
                record["heldout"] = last_score
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{step_losses.loss:.3f}", T=max(T for _, T in step_losses.shapes),
                            **{k: f"{v:.2f}" for k, v in last_score.items()})
            if done % args.save_every == 0 or done == stop:
                save_state(state_path, model, optimizer, done, bank)
    if args.export:  # at the schedule's end, or from the state where --stop-at paused it
        export_checkpoint(model.cpu(), args.export)
    return out


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
