"""Multimodal needles: a code card among N images / video frames, rendered offline with Pillow."""

import random

import pytest

from k3ray.evals.oracle import OracleTarget
from k3ray.evals.scoring import score
from k3ray.evals.tasks import TASKS, Cell, images
from k3ray.evals.tasks.multimodal import VideoNeedle

RIGHT, WRONG = OracleTarget(), OracleTarget(wrong=True)
MM_TASKS = ["image_niah", "video_niah", "video_niah_gif"]


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


@pytest.mark.parametrize("name", MM_TASKS)
@pytest.mark.parametrize("count", [1, 6])
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
