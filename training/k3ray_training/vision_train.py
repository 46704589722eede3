"""Train k3-tiny-vl, the vision-language fixture: `cd training && python -m k3ray_training.vision_train
--out runs/vl [--export DIR]`.

k3-tiny-niah's text model (`--init-from`) grows a MoonViT-V2 tower and PatchMergerMLPV2 projector
(VL_VISION) and learns to read the code card of `k3ray eval mm` among N images and on one frame of
a video (image parts or an animated GIF), while text needle items keep it a needle reader. Every
item goes through the engine's own chat template, media decoding and placeholder expansion
(vision_data); autograd runs through k3ray's tower and the text model's training paths.

Loss: cross-entropy on the answer (the code, then <|im_end|>), plus `--digit-weight` times a
digit loss: each of the card's six digit tokens (cards.Card.tokens) classified among the ten
digits by its cosine to their text embeddings (so the tower learns to read, and writes each digit
where the text model reads digits). The answer's gradient reaches the tower scaled by
`--answer-to-tower`: unscaled, it is 3 to 20 times the digit loss's there (measured at the start)
and drowns it, and the tower never learns to read. Seeded (step s's items depend only on (seed, s)), resumable (rerun the
command), logged to OUT/train_log.jsonl with a teacher-forced held-out exact match per kind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py

import torch  # noqa: E402 - after the OpenMP setting
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from k3ray.config import VisionConfig  # noqa: E402
from k3ray.tokenizer import ByteTokenizer  # noqa: E402
from k3ray.vision import MediaConfig  # noqa: E402
from k3ray.vision.media import pack_media  # noqa: E402
from k3ray.vision.model import K3VisionModel, checked_grid, init_random_vision_weights  # noqa: E402
from k3ray_training import cards, vision_data  # noqa: E402
from k3ray_training.export import export_checkpoint  # noqa: E402
from k3ray_training.init_weights import initial_tower, initial_weights  # noqa: E402
from k3ray_training.model import balance_experts, cosine_lr, niah_config, train_logits, trainable_model  # noqa: E402
from k3ray_training.train import (  # noqa: E402
    BALANCE_RATE,
    LOG_FILE,
    STATE_FILE,
    add_run_flags,
    batch_tensors,
    logged_args,
    parse_shares,
    prepare_run,
    resume_log,
    write_state,
)
from k3ray_training.vision_data import VisionExample  # noqa: E402

# the tower: 3 blocks of width 128 (4 heads of 32), a 12 x 12 position table (a 160 px image's patch grid)
VL_VISION = VisionConfig(hidden_size=128, num_layers=3, num_heads=4, qkv_hidden_size=128, intermediate_size=256,
                         pos_emb_height=12, pos_emb_width=12, pos_emb_time=4, projector_hidden_size=512,
                         text_hidden_size=128)
DEFAULT_MIX = ("image@1=2,image@2,image@4,image@8,frames@8,frames@16,gif@8,gif@16,"
               "niah@ruler+chat=0.5,niah=0.5")
DIGITS = tuple(range(ord("0"), ord("9") + 1))  # the byte tokenizer's digit ids
DIGIT_SCALE = 10.0  # cosine -> logit: a margin the softmax can resolve
HELDOUT_KINDS = ("image@1", "image@2", "image@4", "image@8", "frames@8", "frames@16", "gif@8", "gif@16",
                 "order@8", "order@16", "gif_order@8", "gif_order@16", "niah@ruler+chat")
# the second stage (from k3-tiny-vl's first): the video_order kinds join, the earlier kinds keep their reading
ORDER_MIX = ("image@1,image@2,image@4,image@8,frames@8,frames@16,gif@8,gif@16,order@8=2,order@16=2,"
             "gif_order@8=2,gif_order@16=2,niah@ruler+chat=0.5,niah=0.5")
MIXES = {"cards": DEFAULT_MIX, "order": ORDER_MIX}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (state, log); rerun to resume")
    p.add_argument("--export", default=None, help="write the checkpoint here when the run stops")
    p.add_argument("--init-from", default="k3-tiny-niah",
                   help="the text model's weights: a shipped checkpoint name, a checkpoint directory or a text run's "
                        "train_state.pt; a checkpoint with a tower (k3-tiny-vl) gives the tower's weights too")
    p.add_argument("--mix", default=DEFAULT_MIX,
                   help="item kinds and shares, KIND[=SHARE],...: image@N, frames@N, gif@N, order@N, gif_order@N or a "
                        f"text kind of train.py; or a named mix ({', '.join(MIXES)})")
    p.add_argument("--steps", type=int, default=1500, help="the schedule's length (learning rate)")
    p.add_argument("--stop-at", type=int, default=None, help="stop (and save) after this step; rerun to go on")
    p.add_argument("--tokens-per-step", type=int, default=3072)
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate of the text model")
    p.add_argument("--vision-lr", type=float, default=2e-3, help="peak learning rate of the tower and projector")
    p.add_argument("--digit-weight", type=float, default=1.0,
                   help="weight of the loss classifying each card digit token by its cosine to the digits' text "
                        "embeddings")
    p.add_argument("--answer-to-tower", type=float, default=0.02,
                   help="the share of the answer loss's gradient that reaches the tower and projector")
    p.add_argument("--varied-cards", type=float, default=0.2, metavar="P",
                   help="the share of cards drawn varied (face, size, colours, position) rather than as the eval draws them")
    p.add_argument("--varied-from", type=int, default=300,
                   help="the step varied cards start at (before it the tower learns the eval's card alone)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--heldout-per-kind", type=int, default=4)
    add_run_flags(p, save_every=25)
    args = p.parse_args(argv)
    try:
        args.kind_mix = parse_shares(MIXES.get(args.mix, args.mix), "mix", "image@4=1,gif@8=0.5")
        for kind in args.kind_mix:
            vision_data.parse_kind(kind)
    except ValueError as e:
        p.error(str(e))
    return args


class Data:
    """What building an item needs: the tokenizer, the media settings and the card faces."""

    def __init__(self, vision: VisionConfig) -> None:
        self.tokenizer = ByteTokenizer(niah_config().vocab_size)
        self.media = MediaConfig.for_vision(vision)
        self.placeholder = self.tokenizer.media_placeholder_token_id
        self.faces = cards.installed_faces()

    def item(self, kind: str, rng: random.Random, varied_share: float = 0.0) -> VisionExample:
        return vision_data.make_item(kind, rng, self.tokenizer, self.media, self.placeholder, self.faces, varied_share)


def step_items(args: argparse.Namespace, step: int, source: Data) -> list[VisionExample]:
    rng = random.Random(f"vl:{args.seed}:{step}")
    varied = args.varied_cards if step >= args.varied_from else 0.0
    kinds, shares = zip(*args.kind_mix.items())
    items, tokens = [], 0
    while tokens < args.tokens_per_step:
        items.append(source.item(rng.choices(kinds, shares)[0], rng, varied))
        tokens += len(items[-1].example.prompt) + len(items[-1].example.answer)
    return items


def heldout_items(args: argparse.Namespace, source: Data) -> list[VisionExample]:
    """Fixed items of each held-out kind, with the eval's own card."""
    return [source.item(kind, random.Random(f"heldout:{args.seed}:{kind}:{i}"))
            for kind in HELDOUT_KINDS for i in range(args.heldout_per_kind)]


def groups(items: list[VisionExample], max_tokens: int) -> list[list[VisionExample]]:
    """Items sorted by length, cut into micro-batches of at most max_tokens padded tokens."""
    out: list[list[VisionExample]] = []
    for item in sorted(items, key=lambda v: len(v.example.prompt) + len(v.example.answer)):
        size = len(item.example.prompt) + len(item.example.answer)
        if out and size * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(item)
        else:
            out.append([item])
    return out


def group_logits(model, vision: K3VisionModel, group: list[VisionExample], pad: int,
                 loads: dict[int, torch.Tensor] | None = None, answer_to_tower: float = 1.0):
    """(answer-row logits [R, V], the batch, digit losses [K], digit hits [K]) of one micro-batch."""
    device = next(model.parameters()).device
    batch = batch_tensors([v.example for v in group], pad, prompt_labels=False)
    B, T = batch.ids.shape
    ids = batch.ids.to(device)
    embeds = model.embed(ids)  # [B, T, D]
    digit_losses, digit_hits = torch.zeros(0, device=device), torch.zeros(0, dtype=torch.bool)
    media = [m for v in group for m in v.media]
    if media:
        pixels, grid_thws = pack_media(media)
        encoded = vision(pixels.to(device), checked_grid(vision.config, pixels, grid_thws))  # [M, D]
        flat = torch.cat([b * T + v.media_positions for b, v in enumerate(group)]).to(device)  # [M]
        to_text = answer_to_tower * encoded + (1 - answer_to_tower) * encoded.detach()  # the same values
        embeds = embeds.flatten(0, 1).index_copy(0, flat, to_text.to(embeds.dtype)).view(B, T, -1)
        row_of = {pos: i for i, pos in enumerate(flat.tolist())}
        rows = [row_of[b * T + p] for b, v in enumerate(group) for p in v.digit_positions]
        if rows:
            digits = torch.tensor([DIGITS.index(d) for v in group for d in v.digit_ids], device=device)  # [K]
            table = F.normalize(model.model.embed_tokens.weight[torch.tensor(DIGITS, device=device)].detach(), dim=-1)
            scores = DIGIT_SCALE * F.normalize(encoded[torch.tensor(rows, device=device)], dim=-1) @ table.T  # [K, 10]
            digit_losses = F.cross_entropy(scores, digits, reduction="none")
            digit_hits = (scores.argmax(-1) == digits).cpu()
    logits = train_logits(model, ids, batch.rows.to(device), loads, embeds=embeds)
    return logits, batch, digit_losses, digit_hits


def item_of_rows(group: list[VisionExample]) -> torch.Tensor:
    """[R] the micro-batch item each answer row belongs to."""
    return torch.tensor([b for b, v in enumerate(group) for _ in v.example.answer])


@torch.no_grad()
def heldout_scores(model, vision, items: list[VisionExample], pad: int) -> dict[str, float]:
    """Teacher-forced exact match per kind: every answer token is the argmax (what greedy decoding needs)."""
    model.eval(), vision.eval()
    hits: dict[str, list[bool]] = {}
    for group in groups(items, 4096):
        logits, batch, _, _ = group_logits(model, vision, group, pad)
        right, owner = logits.argmax(-1).cpu() == batch.labels, item_of_rows(group)
        for b, v in enumerate(group):
            hits.setdefault(v.example.task, []).append(bool(right[owner == b].all()))
    model.train(), vision.train()
    return {kind: sum(h) / len(h) for kind, h in hits.items()}


def save_state(path: Path, model, vision, optimizer, step: int) -> None:
    write_state(path, {"model": model.state_dict(), "vision": vision.state_dict(),
                       "optimizer": optimizer.state_dict(), "step": step})


def build(args: argparse.Namespace, device: torch.device):
    """(text model, vision model, optimizer, first step) from the run's state or from --init-from."""
    model = trainable_model(niah_config(), args.seed)
    vision = init_random_vision_weights(K3VisionModel(VL_VISION), args.seed)
    state_path = Path(args.out) / STATE_FILE
    if not state_path.exists():
        initial_weights(model, args.init_from)
        tower = initial_tower(args.init_from)
        if tower is not None:
            vision.load_state_dict(tower.state_dict())
    model.to(device).train(), vision.to(device).train()
    optimizer = torch.optim.AdamW([{"params": list(model.parameters()), "lr": args.lr, "peak": args.lr},
                                   {"params": list(vision.parameters()), "lr": args.vision_lr,
                                    "peak": args.vision_lr}], betas=(0.9, 0.95), weight_decay=0.01)
    start = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=True, map_location=device)
        model.load_state_dict(state["model"])
        vision.load_state_dict(state["vision"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    return model, vision, optimizer, start


def train_step(model, vision, items: list[VisionExample], pad: int, digit_weight: float,
               max_tokens: int, answer_to_tower: float = 1.0) -> tuple[float, float, float, dict[str, float]]:
    """Backward of mean(answer-row losses) + digit_weight * mean(digit losses) over the step's items,
    a micro-batch at a time; returns (answer loss, digit loss, digit accuracy, answer loss per kind)."""
    n_rows = sum(len(v.example.answer) for v in items)
    n_digits = sum(len(v.digit_ids) for v in items)
    loads: dict[int, torch.Tensor] = {}
    total, digit_total, digit_right, per_kind = 0.0, 0.0, 0, {}
    for group in groups(items, max_tokens):
        logits, batch, digit_losses, digit_hits = group_logits(model, vision, group, pad, loads, answer_to_tower)
        losses = F.cross_entropy(logits, batch.labels.to(logits.device), reduction="none")  # [R]
        part = losses.sum() / n_rows
        if n_digits and digit_weight:
            part = part + digit_weight * digit_losses.sum() / n_digits
        part.backward()
        owner = item_of_rows(group)
        for b, v in enumerate(group):
            per_kind.setdefault(v.example.task, []).append(losses[(owner == b).to(losses.device)].mean().item())
        total += losses.sum().item()
        digit_total += digit_losses.sum().item()
        digit_right += int(digit_hits.sum())
    balance_experts(model, loads, BALANCE_RATE)
    n = max(n_digits, 1)
    return total / n_rows, digit_total / n, digit_right / n, {k: round(sum(x) / len(x), 4) for k, x in per_kind.items()}


def train(args: argparse.Namespace) -> Path:
    device, out = prepare_run(args)
    model, vision, optimizer, start = build(args, device)
    source = Data(VL_VISION)
    pad = niah_config().pad_token_id
    heldout = heldout_items(args, source)
    log_path = out / LOG_FILE
    resume_log(log_path, start)
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    bar = tqdm(range(start, stop), initial=start, total=args.steps, desc="train k3-tiny-vl", dynamic_ncols=True)
    began, last_score = time.time(), {}
    params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in vision.parameters())
    with log_path.open("a") as log:
        log.write(json.dumps({"step": start, "event": "start", "params": params, "faces": list(source.faces),
                              "args": logged_args(vars(args) | {"kind_mix": None})}) + "\n")
        for step in bar:
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, args.steps, group["peak"], args.warmup)
            items = step_items(args, step, source)
            optimizer.zero_grad(set_to_none=True)
            loss, digit_loss, digit_acc, per_kind = train_step(model, vision, items, pad, args.digit_weight,
                                                               args.tokens_per_step, args.answer_to_tower)
            torch.nn.utils.clip_grad_norm_([*model.parameters(), *vision.parameters()], 1.0)
            optimizer.step()
            done = step + 1
            record = {"step": done, "loss": round(loss, 4), "digit_loss": round(digit_loss, 4),
                      "digit_accuracy": round(digit_acc, 3),
                      "items": len(items), "seconds": round(time.time() - began, 1), "task_loss": per_kind}
            if done % args.eval_every == 0 or done == args.steps:
                last_score = heldout_scores(model, vision, heldout, pad)
                record["heldout_exact"] = {k: round(v, 3) for k, v in last_score.items()}
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss:.3f}", digit=f"{digit_acc:.2f}",
                            **{k.replace("@", ""): f"{v:.2f}" for k, v in last_score.items()})
            if done % args.save_every == 0 or done == stop:
                save_state(out / STATE_FILE, model, vision, optimizer, done)
    if args.export:
        export_checkpoint(model.cpu(), args.export, vision.cpu(), source.media)
    return out


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
