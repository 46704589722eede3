"""The tiny K3 vision model end to end on CPU: published tensor names, deterministic encoding,
packing invariance (an item encoded alone == encoded packed with others), one output row per
placeholder token, dtype handling, and input validation at `encode_media`."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3ray.config import VisionConfig, k3_config, k3_tiny_config
from k3ray.testing import assert_close
from k3ray.vision import MediaConfig, build_vision_model, encode_media, media_token_count, preprocess_image

VISION = k3_tiny_config().vision
GRIDS = [(1, 4, 6), (3, 2, 4), (1, 8, 8), (4, 6, 2), (2, 10, 4)]


def _pixels(grid, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t * h * w, 3, 14, 14, generator=gen) for t, h, w in grid]


def _png(seed: int, size=(90, 60)) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def test_state_dict_uses_the_published_names():
    model = build_vision_model(VISION, torch.float32, seed=0)
    block = ["norm0", "wqkv", "wo", "norm1", "mlp.fc0", "mlp.fc1"]
    expected = {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                "vision_tower.encoder.final_layernorm.weight", "mm_projector.proj.0.weight",
                "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"}
    expected |= {f"vision_tower.encoder.blocks.{i}.{leaf}.weight" for i in range(VISION.num_layers) for leaf in block}
    assert set(model.state_dict()) == expected


def test_k3_shapes_on_meta():
    with torch.device("meta"):
        model = build_vision_model(k3_config().vision, torch.bfloat16, seed=None)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    assert shapes["vision_tower.patch_embed.proj.weight"] == [1024, 3, 14, 14]
    assert shapes["vision_tower.patch_embed.pos_emb.weight"] == [64, 64, 1024]
    assert shapes["vision_tower.encoder.blocks.0.mlp.fc0.weight"] == [4096, 1024]
    assert shapes["mm_projector.proj.0.weight"] == [4096, 4096]
    assert shapes["mm_projector.proj.2.weight"] == [7168, 4096]
    assert shapes["mm_projector.post_norm.weight"] == [7168]
    assert len(shapes) == 27 * 6 + 6


def test_same_image_gives_bitwise_identical_embeddings():
    config = MediaConfig.for_vision(VISION, max_patches=48)
    first, second = preprocess_image(_png(1), config), preprocess_image(_png(1), config)
    assert first.content_hash == second.content_hash and torch.equal(first.pixel_values, second.pixel_values)
    model = build_vision_model(VISION, torch.bfloat16, seed=2)
    again = build_vision_model(VISION, torch.bfloat16, seed=2)
    out = encode_media(model, first.pixel_values, first.grid_thws)
    assert out.shape == (first.num_tokens, VISION.text_hidden_size) and out.dtype == torch.bfloat16
    assert torch.equal(out, encode_media(model, second.pixel_values, second.grid_thws))
    assert torch.equal(out, encode_media(again, first.pixel_values, first.grid_thws))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_item_alone_equals_item_packed_with_others(dtype):
    model = build_vision_model(VISION, dtype, seed=3)
    pixels = _pixels(GRIDS, seed=4)
    alone = [encode_media(model, p, torch.tensor([g])) for p, g in zip(pixels, GRIDS)]
    packed = encode_media(model, torch.cat(pixels), torch.tensor(GRIDS))
    assert [a.shape[0] for a in alone] == [media_token_count([g]) for g in GRIDS]
    rows = torch.cat(alone)
    if dtype == torch.bfloat16:
        assert torch.equal(rows, packed)
    else:
        assert_close("packed vs alone", rows, packed, 1e-6)  # fp32 GEMMs block a different row count differently


def test_other_items_do_not_leak_into_a_chunk():
    model = build_vision_model(VISION, torch.float32, seed=3)
    a, b = _pixels(GRIDS[:2], seed=5)
    base = encode_media(model, torch.cat([a, b]), torch.tensor(GRIDS[:2]))
    changed = encode_media(model, torch.cat([a, b * -3]), torch.tensor(GRIDS[:2]))
    n_a = media_token_count([GRIDS[0]])
    assert torch.equal(base[:n_a], changed[:n_a])  # same rows, same batch shape: bitwise
    assert not torch.allclose(base[n_a:], changed[n_a:])


def test_bfloat16_model_tracks_float32():
    f32, bf16 = build_vision_model(VISION, torch.float32, seed=6), build_vision_model(VISION, torch.bfloat16, seed=6)
    pixels = torch.cat(_pixels(GRIDS, seed=7))
    ref = encode_media(f32, pixels, torch.tensor(GRIDS))
    out = encode_media(bf16, pixels, torch.tensor(GRIDS)).float()
    assert_close("bf16 tower", ref, out, 3e-2)  # bf16 weights and activations through 2 blocks


@pytest.mark.parametrize(
    "pixels, grid, match",
    [
        (torch.zeros(24, 3, 14, 14), [[5, 2, 2]], "t=5 frames"),
        (torch.zeros(24, 3, 14, 14), [[0, 4, 6]], "t=0 frames"),
        (torch.zeros(15, 3, 14, 14), [[1, 3, 5]], "multiples of 2"),
        (torch.zeros(24, 3, 14, 14), [[1, 4, 4]], "covers 16 patches but pixel_values holds 24"),
        (torch.zeros(24, 3, 16, 16), [[1, 4, 6]], r"\[N, 3, 14, 14\]"),
        (torch.zeros(24, 3, 14, 14, dtype=torch.uint8), [[1, 4, 6]], "float"),
        (torch.zeros(24, 3, 14, 14), [[1.0, 4.0, 6.0]], "integer"),
        (torch.zeros(24, 3, 14, 14), [], "non-empty"),
        (torch.zeros(1028, 3, 14, 14), [[1, 2, 514]], "2D RoPE grid of 512"),
    ],
)
def test_encode_media_rejects_bad_inputs(pixels, grid, match):
    model = build_vision_model(VISION, torch.float32, seed=0)
    with pytest.raises(ValueError, match=match):
        encode_media(model, pixels, torch.tensor(grid) if grid else torch.zeros(0, 3, dtype=torch.long))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_heads=3), "qkv_hidden_size=64 must split into 3 heads"),
        (dict(qkv_hidden_size=40, num_heads=4), "multiple of 4"),
        (dict(projector_hidden_size=100), "projector input 100"),
        (dict(merge_kernel=(2, 0)), "merge_kernel_size"),
        (dict(num_layers=0), "num_layers"),
    ],
)
def test_vision_config_validation(changes, match):
    fields = {f: getattr(VISION, f) for f in VISION.__dataclass_fields__}
    with pytest.raises(ValueError, match=match):
        VisionConfig(**(fields | changes))
