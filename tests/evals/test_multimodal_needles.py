"""Multimodal needles: a code card among N images / video frames, and video_order's two cards,
rendered offline with Pillow."""

import random

import pytest

from k3ray.evals.oracle import OracleTarget
from k3ray.evals.runner import RunConfig, run_eval
from k3ray.evals.scoring import score
from k3ray.evals.tasks import TASKS, Cell, images
from k3ray.evals.tasks.multimodal import ORDER_CHUNK, VideoNeedle, VideoOrder, order_indices

RIGHT, WRONG = OracleTarget(), OracleTarget(wrong=True)
MM_TASKS = ["image_niah", "video_niah", "video_niah_gif"]
ORDER_TASKS = ["video_order", "video_order_gif"]


def _visuals(prompt):
    (message,) = prompt
    assert message["role"] == "user"
    frames = []
    for part in message["content"]:
        if part["type"] in ("image_url", "video_url"):
            url = part[part["type"]]["url"]
            assert url.startswith("data:image/png;base64," if part["type"] == "image_url" else "data:image/gif;base64,")
            frames += images.decode_data_url(url)
    return frames


@pytest.mark.parametrize("name,count", [(n, c) for n in MM_TASKS for c in (1, 6)] + [(n, 6) for n in ORDER_TASKS])
@pytest.mark.parametrize("depth", [0.0, 50.0, 100.0, None])
def test_right_oracle_scores_100_and_wrong_scores_0(name, count, depth):
    item = TASKS[name].build(Cell(name, count, depth), RIGHT, 0)
    assert score(RIGHT.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 1.0
    assert score(WRONG.complete(item.prompt, item.max_tokens), item.answers, item.metric) == 0.0


@pytest.mark.parametrize("name", MM_TASKS)
@pytest.mark.parametrize("depth,index", [(0.0, 0), (40.0, 4), (100.0, 9)])
def test_exactly_one_needle_at_its_depth(name, depth, index):
    item = TASKS[name].build(Cell(name, 10, depth), RIGHT, 0)
    codes = [images.read_code(frame) for frame in _visuals(item.prompt)]
    assert len(codes) == 10
    assert codes[index] == item.answers[0] and sum(c is not None for c in codes) == 1


@pytest.mark.parametrize("name", ORDER_TASKS)
@pytest.mark.parametrize("count,depth,first", [(8, 0.0, 0), (8, 100.0, 3), (10, 50.0, 4), (16, 100.0, 11)])
def test_video_order_shows_two_cards_in_different_chunks_and_asks_for_the_first(name, count, depth, first):
    item = TASKS[name].build(Cell(name, count, depth), RIGHT, 0)
    codes = [images.read_code(frame) for frame in _visuals(item.prompt)]
    shown = [(i, c) for i, c in enumerate(codes) if c is not None]
    assert len(codes) == count and len(shown) == 2 and shown[0] == (first, item.answers[0])
    (_, a), (second, b) = shown
    assert a != b and second // ORDER_CHUNK > first // ORDER_CHUNK
    assert "first of the two cards" in item.prompt[0]["content"][-1]["text"]


def test_order_indices_cover_every_allowed_pair_and_refuse_a_single_chunk(tmp_path):
    rng = random.Random(0)
    pairs = {order_indices(rng, 9) for _ in range(2000)}
    assert pairs == {(i, j) for i in range(8) for j in range(9) if j // ORDER_CHUNK > i // ORDER_CHUNK}
    with pytest.raises(ValueError, match="more than 4 frames"):
        TASKS["video_order"].build(Cell("video_order", 4, 50.0), RIGHT, 0)
    with pytest.raises(ValueError, match="video_order needs --lengths of at least 5 frames, got 4"):
        run_eval(RunConfig(tasks=("video_order",), lengths=(4, 8), depths=(50.0,)), RIGHT, tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # refused before the run wrote anything
    with pytest.raises(ValueError, match="video_format"):
        VideoOrder(video_format="mp4")


def test_video_frames_differ_and_the_gif_is_lossless():
    frames = images.moving_frames(random.Random(0), 8)
    assert len({f.tobytes() for f in frames}) == 8
    decoded = images.decode_data_url(images.gif_data_url(frames))
    assert [f.tobytes() for f in decoded] == [f.tobytes() for f in frames]


def test_reader_reads_every_code_and_nothing_else():
    rng = random.Random(1)
    for _ in range(20):
        code = "".join(rng.choice("0123456789") for _ in range(images.CODE_LENGTH))
        assert images.read_code(images.with_card(images.scene(rng), code)) == code
        assert images.read_code(images.scene(rng)) is None


def test_codes_vary_per_cell_and_repeat_per_seed():
    task = TASKS["image_niah"]
    first = task.build(Cell("image_niah", 3, 50.0), RIGHT, 0).answers
    assert task.build(Cell("image_niah", 3, 50.0), RIGHT, 0).answers == first
    assert task.build(Cell("image_niah", 3, 50.0, sample=1), RIGHT, 0).answers != first


def test_bad_multimodal_settings_are_refused():
    with pytest.raises(ValueError, match="video_format"):
        VideoNeedle(video_format="mp4")
    with pytest.raises(ValueError, match="at least one image"):
        TASKS["image_niah"].build(Cell("image_niah", 0, 50.0), RIGHT, 0)
    with pytest.raises(ValueError, match="digits"):
        images.with_card(images.scene(random.Random(0)), "12ab56")
