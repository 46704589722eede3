"""Video preprocessing without ffmpeg: frame sampling at a target fps / frame cap, chunks of up to
4 frames, animated GIF / APNG bytes and frame lists, per-frame NaViT sizes, and errors."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3ray.config import k3_tiny_config
from k3ray.vision import MediaConfig, build_vision_model, encode_media, preprocess_video
from k3ray.vision.preprocess import navit_size
from k3ray.vision.video import sample_frame_indices, sample_times

VISION = k3_tiny_config().vision
SMALL = MediaConfig.for_vision(VISION, video_max_patches_per_frame=16, video_max_frames=8)


def _frames(count: int, width: int = 40, height: int = 30, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]


def _animation(frames: list[Image.Image], fmt: str, duration) -> bytes:
    buf = io.BytesIO()
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=duration, loop=0)
    return buf.getvalue()


def test_sampling_instants():
    assert sample_times(3.0, 2.0, 64) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    spread = sample_times(100.0, 2.0, 8)  # 200 frames at 2 fps would exceed the cap: spread 8 evenly
    assert spread == [12.5 * k for k in range(8)]
    assert sample_times(0.1, 2.0, 8) == [0.0]  # a clip shorter than one step still gives a frame


def test_frame_indices():
    starts = [i / 30 for i in range(300)]  # 10 s at 30 fps
    assert sample_frame_indices(starts, 10.0, 2.0, 64) == list(range(0, 300, 15))
    assert len(sample_frame_indices(starts, 10.0, 2.0, 4)) == 4
    slow = [float(i) for i in range(5)]  # 1 fps source sampled at 2 fps: each frame once
    assert sample_frame_indices(slow, 5.0, 2.0, 64) == [0, 1, 2, 3, 4]


def test_gif_is_sampled_and_chunked():
    frames = _frames(12)
    item = preprocess_video(_animation(frames, "GIF", 250), SMALL)  # 3 s; 2 fps -> frames 0, 2, 4, 6, 8, 10
    assert item.kind == "video" and item.frame_times == (0.0, 0.5, 1.0, 1.5, 2.0, 2.5)
    (w, h), (pw, ph) = navit_size(40, 30, 14, 2, 16, 512)
    assert item.grid_thws.tolist() == [[4, ph // 14, pw // 14], [2, ph // 14, pw // 14]]
    assert item.num_tokens == 2 * (ph // 28) * (pw // 28) and item.original_size == (40, 30)
    assert item.pixel_values.shape[0] == 6 * (ph // 14) * (pw // 14)


def test_variable_frame_durations():
    durations = [1000, 100, 100, 100, 700]  # starts 0, 1.0, 1.1, 1.2, 1.3 s; 2 s in all
    item = preprocess_video(_animation(_frames(5), "GIF", durations), SMALL)
    # on screen at 0, 0.5, 1.0 and 1.5 s: frames 0, 0 (taken once), 1, 4
    assert item.frame_times == pytest.approx((0.0, 1.0, 1.3)) and item.grid_thws.tolist()[0][0] == 3


def test_apng_reads_like_gif():
    frames = _frames(3)
    item = preprocess_video(_animation(frames, "PNG", 500), SMALL)  # APNG: 1.5 s, every frame
    assert item.grid_thws.tolist()[0][0] == 3 and item.frame_times == (0.0, 0.5, 1.0)
    from_list = preprocess_video(frames, SMALL)
    assert torch.equal(item.pixel_values, from_list.pixel_values)  # lossless frames, same pixels


def test_frame_list_chunks_in_order():
    frames = _frames(9, seed=1)
    config = MediaConfig.for_vision(VISION, video_max_patches_per_frame=16)
    item = preprocess_video(frames, config)
    grid = item.grid_thws.tolist()
    assert [g[0] for g in grid] == [4, 4, 1]
    per_frame = grid[0][1] * grid[0][2]
    images = [preprocess_video([f], config).pixel_values for f in frames]
    assert torch.equal(item.pixel_values, torch.cat(images))  # frame-major: frame k's patches are block k
    assert item.frame_times == tuple(k / 2.0 for k in range(9))
    assert item.pixel_values.shape[0] == 9 * per_frame


def test_frame_list_with_source_fps_and_cap():
    frames = _frames(40)
    item = preprocess_video(frames, SMALL, source_fps=10.0)  # 4 s at 10 fps, sampled at 2 fps: 8 frames
    assert len(item.frame_times) == 8 and item.frame_times[1] == pytest.approx(0.5)
    capped = preprocess_video(_frames(20), SMALL)  # taken as already sampled; cap of 8 spreads evenly
    assert len(capped.frame_times) == 8


def test_frames_of_another_size_take_the_first_frames_geometry():
    frames = _frames(2, 40, 30) + _frames(2, 90, 20, seed=2)
    item = preprocess_video(frames, SMALL)
    assert item.grid_thws.tolist() == [[4] + preprocess_video(frames[:1], SMALL).grid_thws.tolist()[0][1:]]


def test_video_encodes_to_its_token_count():
    item = preprocess_video(_frames(5), SMALL)
    model = build_vision_model(VISION, torch.float32, seed=0)
    assert encode_media(model, item.pixel_values, item.grid_thws).shape == (item.num_tokens, VISION.text_hidden_size)


@pytest.mark.parametrize(
    "data, kw, match",
    [
        ([], {}, "frame list is empty"),
        (b"garbage", {}, "video: cannot decode"),
        ("clip.mp4", {}, "unsupported media type str"),
        (42, {}, "unsupported media type int"),
        ([b"not a frame"], {}, "video frame 0: cannot decode"),
        (_frames(2), {"source_fps": 0.0}, "source_fps must be positive"),
    ],
)
def test_bad_videos_raise_value_error(data, kw, match):
    with pytest.raises(ValueError, match=match):
        preprocess_video(data, SMALL, **kw)


def test_video_limits():
    gif = _animation(_frames(6), "GIF", 100)
    with pytest.raises(ValueError, match="6 frames exceeds the limit of 5"):
        preprocess_video(gif, MediaConfig.for_vision(VISION, max_source_frames=5))
    with pytest.raises(ValueError, match="6 frames exceeds the limit of 5"):
        preprocess_video(_frames(6), MediaConfig.for_vision(VISION, max_source_frames=5))
    with pytest.raises(ValueError, match="1200 pixels exceeds the limit of 1000"):
        preprocess_video(gif, MediaConfig.for_vision(VISION, max_input_pixels=1000))
    with pytest.raises(ValueError, match="7200 pixels to decode exceeds the limit of 7000"):
        preprocess_video(gif, MediaConfig.for_vision(VISION, max_video_source_pixels=7000))
