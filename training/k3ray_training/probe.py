"""Where a needle's key is readable in a model: `python -m k3ray_training.probe --model k3-tiny-niah`.

A multikey lookup needs the asked key at the row that answers and each needle's key at its number's
first digit, in codes a head's q.k can match. For every token mixer's input and output this reads, on
multikey_chain items, how often a question's features pick its own number among its item's numbers:
by centred cosine (what an untrained read sees) and by a rank-r bilinear form fitted on half the items
and scored on the other half (what a head could learn). Chance is 1 / (numbers per item).

Measured on k3-tiny-niah as shipped before its multikey stages (commit 77fc49c; 500 items at 700
characters, 1,000 held-out lookups, chance 0.25 +- 0.014): 0.22-0.30 at most sites by the fitted form,
0.35 at best (6.kda.out), so its 0.40 on niah_multikey_1 is barely a lookup by key. A training-only
linear probe of the key's bytes on the first MLA layer's input at both rows, trained with the model from
those weights (lr 1e-3), stayed at the bytes' marginal entropy for 80 steps: the KDA layers did not start
to carry the key there. The train script's key-gather hop (--gather-attention 0.5 --fingerprint-contrast
0.5 --copy-attention 0.3 --copy-rows lead, 200 steps from the shipped weights) lifts 3.mla.out to 0.54 by
the fitted form; 4.kda.in stays at 0.26 and 7.mla.in at 0.29, and the same probe on 7.mla.in with a match
loss there (70 more steps) stayed at the marginal entropy while the niah needle's first-digit loss rose
from 0.01 to 1.5-2.2.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3ray.tokenizer import ByteTokenizer

from k3ray_training.data import CHAIN_TASK, Example, make_example
from k3ray_training.init_weights import trained_niah_model
from k3ray_training.model import niah_config, train_logits
from k3ray_training.train import copy_targets


@dataclass(frozen=True)
class Lookups:
    """One site's lookups, each a question against its item's numbers (padded to the widest item)."""
    questions: torch.Tensor  # [L, D] the answer rows' features
    numbers: torch.Tensor  # [L, N, D] the item's numbers' first-digit features
    present: torch.Tensor  # [L, N] bool: a real number, not padding
    answers: torch.Tensor  # [L] index of the question's own number

    def __len__(self) -> int:
        return len(self.answers)

    def subset(self, keep: torch.Tensor) -> Lookups:
        return Lookups(self.questions[keep], self.numbers[keep], self.present[keep], self.answers[keep])

    def chance(self) -> float:
        return (1.0 / self.present.sum(-1).float()).mean().item()


def item_lookups(example: Example, digit_ids: set[int]) -> list[tuple[int, list[int], int]]:
    """(answer row, the item's numbers' first-digit positions, index of the asked one) per question
    whose answer is a number the prompt already holds."""
    pairs = copy_targets(example, digit_ids, first=1)
    numbers = sorted({source for _, source in pairs})
    return [(row, numbers, numbers.index(source)) for row, source in pairs]


def site_lookups(traces: list[dict[str, torch.Tensor]], rows: list[list[tuple[int, list[int], int]]],
                 site: str) -> tuple[Lookups, torch.Tensor]:
    """Each item's trace [1, T, D] at site -> its Lookups and the item index of each lookup [L]."""
    width = max(len(numbers) for item in rows for _, numbers, _ in item)
    questions, numbers, present, answers, owners = [], [], [], [], []
    for index, (trace, item) in enumerate(zip(traces, rows)):
        features = trace[site][0]  # [T, D]
        for row, sources, answer in item:
            padded = torch.zeros(width, features.shape[-1])
            padded[: len(sources)] = features[sources]
            questions.append(features[row])
            numbers.append(padded)
            present.append(torch.arange(width) < len(sources))
            answers.append(answer)
            owners.append(index)
    lookups = Lookups(torch.stack(questions), torch.stack(numbers), torch.stack(present), torch.tensor(answers))
    return lookups, torch.tensor(owners)


def _picks(scores: torch.Tensor, lookups: Lookups) -> float:
    """scores [L, N] -> the share of lookups whose top real number is their own."""
    return (scores.masked_fill(~lookups.present, float("-inf")).argmax(-1) == lookups.answers).float().mean().item()


Means = tuple[torch.Tensor, torch.Tensor]  # [D] the questions' and the numbers' mean features


def site_means(lookups: Lookups) -> Means:
    """Each side's common component, which a cosine drops (the two sites differ in it)."""
    return lookups.questions.mean(0), lookups.numbers[lookups.present].mean(0)


def cosine_pick(lookups: Lookups, means: Means) -> float:
    q = F.normalize(lookups.questions - means[0], dim=-1)  # [L, D]
    n = F.normalize(lookups.numbers - means[1], dim=-1)  # [L, N, D]
    return _picks(torch.einsum("ld,lnd->ln", q, n), lookups)


def _bilinear_scores(lookups: Lookups, means: Means, wq: torch.Tensor, wk: torch.Tensor) -> torch.Tensor:
    return torch.einsum("lr,lnr->ln", (lookups.questions - means[0]) @ wq, (lookups.numbers - means[1]) @ wk)  # [L, N]


def fit_bilinear(lookups: Lookups, means: Means, rank: int, steps: int, seed: int,
                 weight_decay: float = 3e-2) -> tuple[torch.Tensor, torch.Tensor]:
    """A head's q.k fitted to pick each question's own number: wq, wk [D, rank]."""
    generator = torch.Generator().manual_seed(seed)
    D = lookups.questions.shape[-1]
    wq = (torch.randn(D, rank, generator=generator) * D**-0.5).requires_grad_()
    wk = (torch.randn(D, rank, generator=generator) * D**-0.5).requires_grad_()
    optimizer = torch.optim.Adam([wq, wk], lr=3e-3, weight_decay=weight_decay)
    for _ in range(steps):
        scores = _bilinear_scores(lookups, means, wq, wk).masked_fill(~lookups.present, float("-inf"))
        loss = F.cross_entropy(scores, lookups.answers)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return wq.detach(), wk.detach()


def readability(lookups: Lookups, owners: torch.Tensor, rank: int = 32, steps: int = 400,
                seed: int = 0) -> dict[str, float]:
    """Pick rates at one site: centred cosine and a bilinear form fitted on the first half of the items,
    both scored on the second half (a question and its numbers never straddle the halves)."""
    assert len(owners.unique()) >= 2, "the halves need an item each"
    items = owners.unique()
    held_out = owners >= items[len(items) // 2]
    fit, test = lookups.subset(~held_out), lookups.subset(held_out)
    means = site_means(fit)
    wq, wk = fit_bilinear(fit, means, rank, steps, seed)
    return {"cosine": cosine_pick(test, means), "bilinear": _picks(_bilinear_scores(test, means, wq, wk), test),
            "bilinear_fit": _picks(_bilinear_scores(fit, means, wq, wk), fit), "chance": test.chance(),
            "lookups": len(test)}


@torch.no_grad()
def trace_items(model, examples: list[Example]) -> list[dict[str, torch.Tensor]]:
    traces = []
    for example in examples:
        trace: dict[str, torch.Tensor] = {}
        train_logits(model, torch.tensor([example.prompt + example.answer]), torch.tensor([0]), trace=trace)
        traces.append(trace)
    return traces


def probe(model, examples: list[Example], digit_ids: set[int], rank: int = 32, steps: int = 400,
          seed: int = 0) -> tuple[dict[str, dict[str, float]], list[float]]:
    """-> (site ("{layer}.{kda|mla}.{in|out}") -> readability(...) over the examples' lookups, the output
    AttnRes weight of each source at the rows that answer: which blocks the answer is read from)."""
    rows = [item_lookups(e, digit_ids) for e in examples]
    kept = [(e, r) for e, r in zip(examples, rows) if r]
    if len(kept) < 2:
        raise ValueError("the probe needs at least two items whose answers are numbers in their prompts")
    traces = trace_items(model, [e for e, _ in kept])
    report = {}
    for site in [s for s in traces[0] if s.endswith((".in", ".out"))]:
        lookups, owners = site_lookups(traces, [r for _, r in kept], site)
        report[site] = readability(lookups, owners, rank, steps, seed)
    answer_rows = [t["output.weights"][0, [row for row, _, _ in r]] for t, (_, r) in zip(traces, kept)]
    return report, torch.cat(answer_rows).mean(0).tolist()


def source_names(model) -> list[str]:
    """The output AttnRes sources: the embedding, each closed block's layers, the last (open) block's."""
    block, layers = model.config.attn_res_block_size, len(model.model.layers)
    return ["embedding"] + [f"layers {i}-{min(i + block, layers) - 1}" for i in range(0, layers, block)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3ray_training.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="k3-tiny-niah", help="a shipped name, checkpoint directory or train_state.pt")
    p.add_argument("--items", type=int, default=60, help="multikey_chain items (half fit, half scored)")
    p.add_argument("--haystack", type=int, default=700, help="haystack characters per item")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.items < 2:
        p.error("--items must be at least 2 (half fit, half scored)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = niah_config()
    tokenizer = ByteTokenizer(config.vocab_size)
    model = trained_niah_model(args.model)
    rng = random.Random(f"probe:{args.seed}")
    examples = [make_example(CHAIN_TASK, args.haystack, rng, tokenizer) for _ in range(args.items)]
    report, weights = probe(model, examples, set(tokenizer.encode("0123456789")), args.rank, args.steps, args.seed)
    print(f"{'site':12s} {'cosine':>7s} {'bilinear':>9s} {'(fit)':>6s} {'chance':>7s}")
    for site, r in report.items():
        print(f"{site:12s} {r['cosine']:7.2f} {r['bilinear']:9.2f} {r['bilinear_fit']:6.2f} {r['chance']:7.2f}")
    answer_sources = dict(zip(source_names(model), weights))
    print("output AttnRes weight at the answer rows: " + ", ".join(f"{k} {w:.2f}" for k, w in answer_sources.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "sites": report, "answer_sources": answer_sources}, f, indent=1)


if __name__ == "__main__":
    main()
