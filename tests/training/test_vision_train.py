"""The k3-tiny-vl training program: its items are the requests the server builds (chat template,
media decoding, placeholder expansion), its cards say which tokens hold the digits, a few steps
lower the loss and resume exactly, and its export loads with its tower and image processor settings."""

import json
import os
import pathlib
import random
import re

import pytest
import torch
from PIL import Image

from k3ray.api import K3
from k3ray.engine import LLM
from k3ray.engine.media.inputs import PREPROCESSOR_CONFIG, load_media_config
from k3ray.evals.engine_target import EngineTarget
from k3ray.evals.tasks import images, multimodal
from k3ray.vision import MediaConfig
from k3ray.vision.weights import load_vision
from k3ray_training import cards, vision_data
from k3ray_training.vision_train import (
    LOG_FILE,
    STATE_FILE,
    VL_VISION,
    ORDER_MIX,
    Data,
    build,
    groups,
    heldout_items,
    main,
    parse_args,
)

TINY_RUN = ["--mix", "image@1=2,gif@4", "--tokens-per-step", "900", "--eval-every", "3", "--heldout-per-kind", "1",
            "--warmup", "1", "--vision-lr", "3e-3"]


@pytest.fixture(scope="module")
def source() -> Data:
    return Data(VL_VISION)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A one-step run's export (the tower, its settings, the text model)."""
    root = tmp_path_factory.mktemp("vl")
    main(["--out", str(root / "run"), "--steps", "1", "--export", str(root / "ckpt"), *TINY_RUN])
    return root / "ckpt"


def _log(run) -> list[dict]:
    return [json.loads(line) for line in (run / LOG_FILE).read_text().splitlines()]


def _losses(run) -> list[float]:
    return [r["loss"] for r in _log(run) if "loss" in r]


def test_the_eval_card_is_the_evals_and_its_digits_sit_in_one_token_row():
    img = images.scene(random.Random(0))
    card = cards.eval_card(img, "482913")
    assert card.image.tobytes() == images.with_card(img, "482913").tobytes()
    assert images.read_code(card.image) == "482913"
    row = card.tokens[0] // cards.GRID_SIDE
    assert card.tokens == tuple(row * cards.GRID_SIDE + j for j in range(6))
    # the row's 28 px band holds the digits' vertical centre (ink between y 69 and 88)
    ink = [y for y in range(images.SIZE[1]) if card.image.getpixel((images._TEXT_X + 4, y)) == images.BLACK]
    assert row * cards.TOKEN_PX <= (min(ink) + max(ink)) / 2 < (row + 1) * cards.TOKEN_PX


def test_varied_cards_move_their_token_row_with_them():
    rows = set()
    for seed in range(40):
        rng = random.Random(seed)
        grey = Image.new("RGB", images.SIZE, (128, 128, 128))
        card = cards.varied_card(grey, "808080", rng, cards.installed_faces())
        row = card.tokens[0] // cards.GRID_SIDE
        rows.add(row)
        text = card.image.convert("L").crop((images.CARD[0] + 8, 0, images.CARD[2] - 8, images.SIZE[1]))  # no side border
        dark = [sum(text.getpixel((x, y)) < 100 for x in range(text.width)) / text.width for y in range(text.height)]
        ink = [y for y, share in enumerate(dark) if 0 < share < 0.9]  # the digits' rows (not the border's)
        assert row * cards.TOKEN_PX <= (min(ink) + max(ink)) / 2 < (row + 1) * cards.TOKEN_PX, seed
    assert len(rows) >= 3


@pytest.mark.parametrize("kind", ["image@1", "image@4", "frames@4", "gif@6"])
def test_items_are_the_prompts_the_engine_builds_and_name_the_cards_tokens(kind, source):
    item = source.item(kind, random.Random(7))
    prompt, answer = item.example.prompt, source.tokenizer.decode(item.example.answer)
    assert answer.endswith("<|im_end|>") and images.read_code is not None
    code = answer.removesuffix("<|im_end|>")
    assert len(code) == 6 and code.isdigit() and item.digit_ids == tuple(source.tokenizer.encode(code))
    placeholder = source.placeholder
    assert [i for i, t in enumerate(prompt) if t == placeholder] == item.media_positions.tolist()
    assert all(prompt[p] == placeholder for p in item.digit_positions)
    assert item.media_positions.numel() == sum(m.num_tokens for m in item.media)
    # the same chat through the eval's builders and the engine's own path gives the same ids
    kind_name, count = vision_data.parse_kind(kind)
    assert item.example.task == kind and count >= 1 and kind_name in vision_data.MEDIA_KINDS


@pytest.mark.parametrize("kind", ["order@6", "gif_order@9"])
def test_order_items_hold_two_cards_and_answer_the_first(kind, source):
    name, count = vision_data.parse_kind(kind)
    messages, indices, placed = vision_data.media_chat(name, count, random.Random(11), source.faces, 0.0)
    shown = [images.read_code(f) for p in messages[0]["content"] if p["type"] != "text"
             for f in images.decode_data_url(p[p["type"]]["url"])]
    assert [(i, c) for i, c in enumerate(shown) if c] == [(indices[0], placed[0].code), (indices[1], placed[1].code)]
    assert multimodal.read(messages) == placed[0].code != placed[1].code
    item = source.item(kind, random.Random(11))  # the same draw, as the engine's ids
    assert source.tokenizer.decode(item.example.answer) == placed[0].code + "<|im_end|>"
    assert item.digit_ids == tuple(source.tokenizer.encode(placed[0].code + placed[1].code))
    first, second = item.digit_positions[:6], item.digit_positions[6:]
    assert all(item.example.prompt[p] == source.placeholder for p in first + second)
    grid_of = {p: i // cards.GRID_SIDE**2 for i, p in enumerate(item.media_positions.tolist())}
    per_grid = 4 if name == "gif_order" else 1  # a grid of tokens per frame, or per chunk of 4 GIF frames
    assert {grid_of[p] for p in first} == {indices[0] // per_grid}
    assert {grid_of[p] for p in second} == {indices[1] // per_grid}


def test_training_prompts_equal_the_in_process_targets(exported, source):
    """A checkpoint exported with the tower: EngineTarget (the eval's in-process path) encodes the
    eval's messages to the ids training builds for the same pictures."""
    target = EngineTarget(LLM(str(exported), max_model_len=2048))
    rng = random.Random(3)
    pictures = [images.scene(rng) for _ in range(3)]
    pictures[1] = images.with_card(pictures[1], "123456")
    frames = images.moving_frames(rng, 6)
    for messages in (multimodal.image_messages(pictures), multimodal.video_messages(frames, "gif"),
                     multimodal.video_messages(frames, "frames")):
        example, media, _ = vision_data._chat(messages, "123456", source.tokenizer, source.media, source.placeholder)
        assert target.prompt_ids(messages) == example.prompt
        ids, served_media = target.prompt_inputs(messages)
        assert [m.num_tokens for m in served_media] == [m.num_tokens for m in media]
        assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(served_media, media))


def test_held_out_items_use_the_eval_card(source):
    args = parse_args(["--out", "unused", "--heldout-per-kind", "1"])
    items = heldout_items(args, source)
    assert {v.example.task for v in items} >= {"image@8", "frames@16", "gif@16", "niah@ruler+chat"}
    assert [len(g) for g in groups(items, 4096)] and sum(map(len, groups(items, 4096))) == len(items)


def test_bad_kinds_are_refused():
    for bad in ("image", "image@0", "gif@x", "photo@3", "order@4", "gif_order@2"):
        with pytest.raises(SystemExit):
            parse_args(["--out", "unused", "--mix", bad])


def test_a_few_steps_lower_the_loss_and_resume_exactly(tmp_path):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    main(["--out", str(whole), "--steps", "4", *TINY_RUN])
    losses = _losses(whole)
    assert len(losses) == 4
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    assert all(r["digit_loss"] > 0 for r in _log(whole) if "loss" in r)
    assert any("heldout_exact" in r for r in _log(whole))
    main(["--out", str(halves), "--steps", "4", "--stop-at", "2", *TINY_RUN])
    assert len(_losses(halves)) == 2
    main(["--out", str(halves), "--steps", "4", *TINY_RUN])
    assert _losses(halves) == pytest.approx(losses, rel=1e-3)
    state = torch.load(halves / STATE_FILE, weights_only=True)
    assert state["step"] == 4 and any(k.startswith("vision_tower.") for k in state["vision"])


def test_a_run_from_a_checkpoint_with_a_tower_starts_from_its_tower(exported, tmp_path):
    args = parse_args(["--out", str(tmp_path / "run"), "--init-from", str(exported), "--mix", "order"])
    assert args.kind_mix == parse_args(["--out", "unused", "--mix", ORDER_MIX]).kind_mix
    _, vision, _, start = build(args, torch.device("cpu"))
    tower = load_vision(exported, torch.float32).state_dict()
    assert start == 0 and all(torch.equal(t, tower[k]) for k, t in vision.state_dict().items())


def test_the_export_loads_with_its_tower_and_image_processor_settings(exported):
    ckpt = exported
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["vision_config"]["vt_hidden_size"] == VL_VISION.hidden_size
    assert hf["quantization_config"]["format"] == "mxfp4-pack-quantized"
    media = load_media_config(ckpt, VL_VISION)
    assert media == MediaConfig.for_vision(VL_VISION)
    assert json.loads((ckpt / PREPROCESSOR_CONFIG).read_text()) == media.to_preprocessor_config()
    assert sum(f.stat().st_size for f in ckpt.iterdir()) < 15 * 2**20
    k3 = K3.load(str(ckpt), device="cpu")
    assert k3.model.config.vision == VL_VISION
    out = LLM(str(ckpt)).chat(multimodal.image_messages([images.with_card(images.scene(random.Random(1)), "111111")]))
    assert out[0].outputs[0].token_ids  # it answers an image chat


def test_the_shipped_checkpoints_log_names_no_machine_path():
    log = pathlib.Path(__file__).resolve().parents[2] / "training" / "k3-tiny-vl" / LOG_FILE
    records = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [r["args"] for r in records if r.get("event") == "start"]
    assert starts and starts[0]["init_from"] == "k3-tiny-niah"
    paths = [a[k] for a in starts for k in ("out", "init_from", "export") if a.get(k)]
    assert not [p for p in paths if os.path.isabs(p) or re.search(r"(^|/)(tmp|s\d+)(/|$)", p)]
    assert records[-1]["step"] == starts[-1]["steps"] and "heldout_exact" in records[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_run_asked_for_cuda_on_a_machine_without_it_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--device: device 'cuda' asks for CUDA"):
        main(["--out", str(tmp_path / "run"), "--steps", "1", "--device", "cuda", *TINY_RUN])
    assert not (tmp_path / "run").exists()
