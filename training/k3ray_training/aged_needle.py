"""A needle prompt read from KDA states aged on N tokens of haystack: the long-context test in minutes.
`python -m k3ray_training.aged_needle --ages 0,256k,1m --length 8k`

Each KDA layer starts an 8K-token niah prompt (the cells `k3ray eval` builds, their answers appended and
teacher-forced) from the states that N tokens of essay haystack left, while its MLA layers see only
the prompt. On the k3-tiny-niah before stage I (docs/multikey-lookup.md) this reproduced the 1M-token
failure: 6 prompts at 8K read all 42 digits right from fresh states and 33 after 1M aged tokens
("388853" for 3883735), as `k3ray eval`'s real 1M prompts lost their late digits. Aging 1M tokens costs
5 minutes on two threads; a real 1M prompt an hour. It isolates the KDA half of length: the MLA softmax
over a million keys is not in it.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

import torch

from k3ray.evals.cli import parse_lengths
from k3ray.evals.haystack import load_corpus
from k3ray.tokenizer import ByteTokenizer

from k3ray_training.init_weights import trained_niah_model
from k3ray_training.model import KdaCarry, train_logits
from k3ray_training.needle_attention import Prompt, needle_prompt
from k3ray_training.state_bank import Chain, StateBank, haystack_ids, initial_states

AGE_PIECE = 8192  # haystack tokens aged per forward


@dataclass(frozen=True)
class Reading:
    depth: float
    seed: int
    answer: str
    read: str  # the argmax at each answer row, teacher-forced
    digits_right: int
    worst_logprob: float  # the lowest log-probability of a true answer digit


@torch.no_grad()
def read_needle(model, tokenizer: ByteTokenizer, prompt: Prompt, start: Chain | None, depth: float,
                seed: int) -> Reading:
    ids = tokenizer.encode(prompt.text)
    n = len(prompt.answer)
    rows = torch.arange(len(ids) - n - 1, len(ids) - 1)  # each row predicts the next answer digit
    carry = KdaCarry(torch.ones(1, len(ids), dtype=torch.bool), initial_states([start], model))
    logits = train_logits(model, torch.tensor([ids]), rows, carry=carry).float()  # [n, V]
    want = torch.tensor(ids[-n:])
    read = logits.argmax(-1)
    logprob = logits.log_softmax(-1).gather(1, want[:, None]).min().item()
    text = tokenizer.decode([t for t in read.tolist() if t < 256])
    return Reading(depth, seed, prompt.answer, text, int((read == want).sum()), round(logprob, 2))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3ray_training.aged_needle", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="k3-tiny-niah",
                   help="a shipped name, a checkpoint directory or a training run's train_state.pt (niah config)")
    p.add_argument("--ages", default="0,256k,1m", help="haystack tokens the KDA states read first, e.g. 0,256k,1m")
    p.add_argument("--length", default="8k", help="the needle prompts' length in tokens")
    p.add_argument("--depths", default="0,50,100", help="needle depths in percent")
    p.add_argument("--seeds", default="0,1", help="the cells' seeds: one prompt per depth and seed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the readings here")
    args = p.parse_args(argv)
    try:
        args.age_list = sorted(0 if a.strip() == "0" else parse_lengths(a)[0] for a in args.ages.split(","))
        args.prompt_length = parse_lengths(args.length)[0]
        args.depth_list = [float(d) for d in args.depths.split(",")]
        args.seed_list = [int(s) for s in args.seeds.split(",")]
    except ValueError as e:
        p.error(str(e))
    if any(not 0 <= d <= 100 for d in args.depth_list):
        p.error(f"--depths must be in [0, 100], got {args.depths}")
    if any(a % AGE_PIECE for a in args.age_list):
        p.error(f"--ages must be multiples of {AGE_PIECE} tokens, got {args.ages}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = trained_niah_model(args.model)
    tokenizer = ByteTokenizer(model.config.vocab_size)
    prompts = [(d, s, needle_prompt(args.prompt_length, d, s, None)) for s in args.seed_list for d in args.depth_list]
    corpus, rng = load_corpus(), random.Random("aged-needle")
    bank = StateBank(1, 1.0)
    report = []
    for age in args.age_list:
        while bank.ages()[0] < age:
            bank.age(model, [haystack_ids(corpus, rng, AGE_PIECE, tokenizer.encode)])
        readings = [read_needle(model, tokenizer, p, bank.chains[0], d, s) for d, s, p in prompts]
        exact = sum(r.digits_right == len(r.answer) for r in readings)
        norms = {} if bank.chains[0] is None else {k: round(v.norm().item(), 1) for k, v in bank.chains[0].states.items()}
        print(f"aged {age} tokens: {exact} of {len(readings)} needles exact, "
              f"{sum(r.digits_right for r in readings)} of {sum(len(r.answer) for r in readings)} digits; "
              + " ".join(f"{r.answer}->{r.read}" for r in readings), flush=True)
        report.append({"age": age, "exact": exact, "state_norms": norms, "readings": [r.__dict__ for r in readings]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "length": args.prompt_length, "ages": report}, f, indent=1)


if __name__ == "__main__":
    main()
