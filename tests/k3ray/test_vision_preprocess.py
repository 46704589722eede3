"""Image preprocessing: NaViT geometry against transformers 5.18.0 K2.5 `navit_resize`, exact output
sizes, normalisation, padding and patch layout, formats and transparency, content hashes, limits and
errors for bad media, data URLs and the preprocessor-config reader."""

import ast
import base64
import io
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from k3ray.config import k3_tiny_config
from k3ray.vision import MediaConfig, data_url_bytes, preprocess_image, preprocess_media
from k3ray.vision.preprocess import navit_size

VISION = k3_tiny_config().vision
SMALL = MediaConfig.for_vision(VISION, max_patches=64)


def _k25_navit_resize():
    """transformers' K2.5 `navit_resize`, read from the installed source: the module itself needs
    torchvision (not installed here) only for its image class."""
    from transformers.models import kimi_k25

    source = Path(kimi_k25.__file__).with_name("image_processing_kimi_k25.py").read_text()
    tree = ast.parse(source)
    func = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "navit_resize")
    namespace = {"math": math}
    exec(compile(ast.Module([func], type_ignores=[]), "navit_resize", "exec"), namespace)
    return namespace["navit_resize"]


def _encode(rgb: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, fmt, **kw)
    return buf.getvalue()


def _random_rgb(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _unpatchify(pixel_values: torch.Tensor, grid) -> torch.Tensor:
    """[t*gh*gw, 3, p, p] -> [t, 3, gh*p, gw*p]."""
    t, gh, gw = grid
    p = pixel_values.shape[-1]
    return pixel_values.view(t, gh, gw, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(t, 3, gh * p, gw * p)


def _expected_pixels(rgb: np.ndarray, padded_hw) -> torch.Tensor:
    """Reference normalisation of a padded frame: (x / 255 - 0.5) / 0.5 per channel, black padding."""
    frame = np.zeros((*padded_hw, 3), dtype=np.float64)
    frame[: rgb.shape[0], : rgb.shape[1]] = rgb
    return torch.from_numpy((frame / 255.0 - 0.5) / 0.5).permute(2, 0, 1)


# geometry ----------------------------------------------------------------------------------------
SIZES = [(1, 1), (13, 13), (14, 14), (27, 29), (150, 100), (640, 480), (1920, 1080), (4000, 3000),
         (7169, 20), (20, 9000), (1821, 7069), (10_000, 10_000), (333, 7777), (28, 28), (29, 57)]


@pytest.mark.parametrize("budget", [(16384, 512), (4096, 512), (64, 512), (256, 16), (65536, 512)])
def test_geometry_matches_k25_navit_resize(budget):
    oracle = _k25_navit_resize()
    max_patches, per_side = budget
    for width, height in SIZES:
        (oh, ow), (ph, pw) = oracle(height, width, 14, 2, max_patches, per_side)
        assert navit_size(width, height, 14, 2, max_patches, per_side) == ((ow, oh), (pw, ph)), (width, height)


@pytest.mark.parametrize("width, height", SIZES)
def test_geometry_properties(width, height):
    (w, h), (pw, ph) = navit_size(width, height, 14, 2, 16384, 512)
    assert pw % 28 == 0 and ph % 28 == 0 and 0 <= pw - w < 28 and 0 <= ph - h < 28
    assert w <= width and h <= height  # never upscaled
    # the scale comes from the source's floor(w/14) * floor(h/14), so the resized count may pass the budget slightly
    assert (w // 14) * (h // 14) <= 16384 * 1.01 and max(w, h) <= 512 * 14
    if min(w, h) > 28:  # aspect ratio kept up to the integer truncation of each side
        assert abs(w / h - width / height) <= (width / height) * (1 / w + 1 / h) * 1.01


def test_image_sizes_are_exact():
    small = preprocess_image(_encode(_random_rgb(150, 100)), SMALL)
    assert small.grid_thws.tolist() == [[1, 8, 12]] and small.pixel_values.shape == (96, 3, 14, 14)
    assert small.num_tokens == 24 and small.kind == "image" and small.original_size == (150, 100)
    tiny = preprocess_image(_encode(_random_rgb(10, 10)), SMALL)
    assert tiny.grid_thws.tolist() == [[1, 2, 2]] and tiny.num_tokens == 1
    big = preprocess_image(_encode(_random_rgb(2000, 1000)), SMALL)
    (w, h), (pw, ph) = navit_size(2000, 1000, 14, 2, 64, 512)
    assert big.grid_thws.tolist() == [[1, ph // 14, pw // 14]] and big.num_tokens == (ph // 28) * (pw // 28)
    assert (w // 14) * (h // 14) <= 64


def test_normalisation_padding_and_patch_order():
    rgb = _random_rgb(45, 30, seed=3)  # within the budget: no resize, padded to 56 x 56
    item = preprocess_image(_encode(rgb), SMALL)
    assert item.grid_thws.tolist() == [[1, 4, 4]]
    image = _unpatchify(item.pixel_values, (1, 4, 4))[0]
    torch.testing.assert_close(image, _expected_pixels(rgb, (56, 56)).float(), rtol=0, atol=1e-6)  # fp32 vs fp64
    assert torch.equal(item.pixel_values[1], image[:, 0:14, 14:28])  # patch 1 = row 0, column 1 (raster)
    assert torch.all(image[:, 30:, :] == -1) and torch.all(image[:, :, 45:] == -1)  # black padding


@pytest.mark.parametrize("fmt, kw", [("PNG", {}), ("JPEG", {"quality": 95}), ("WEBP", {"lossless": True}),
                                     ("BMP", {}), ("GIF", {}), ("TIFF", {})])
def test_formats_decode(fmt, kw):
    rgb = _random_rgb(40, 30, seed=4)
    item = preprocess_image(_encode(rgb, fmt, **kw), SMALL)
    assert item.grid_thws.tolist() == [[1, 4, 4]]
    if fmt in ("PNG", "WEBP", "BMP", "TIFF"):  # lossless: exactly the source pixels
        assert torch.equal(item.pixel_values, preprocess_image(Image.fromarray(rgb), SMALL).pixel_values)


def test_grayscale_palette_and_cmyk_become_rgb():
    gray = np.full((20, 20), 200, dtype=np.uint8)
    item = preprocess_image(_encode(gray), SMALL)
    content = _unpatchify(item.pixel_values, (1, 2, 2))[0, :, :20, :20]
    assert torch.allclose(content, torch.full_like(content, 200 / 255 * 2 - 1))
    palette = Image.fromarray(_random_rgb(20, 20)).convert("P")
    assert preprocess_image(palette, SMALL).grid_thws.tolist() == [[1, 2, 2]]
    buf = io.BytesIO()
    Image.fromarray(_random_rgb(20, 20)).convert("CMYK").save(buf, "JPEG")
    assert preprocess_image(buf.getvalue(), SMALL).grid_thws.tolist() == [[1, 2, 2]]


def test_transparency_is_flattened_onto_the_chessboard():
    clear = np.zeros((20, 20, 4), dtype=np.uint8)
    item = preprocess_image(_encode(clear), SMALL)
    image = (_unpatchify(item.pixel_values, (1, 2, 2))[0] + 1) / 2 * 255
    assert torch.allclose(image[:, 0, 0], torch.full((3,), 255.0), atol=1e-3)  # white top-left square
    assert torch.allclose(image[:, 0, 8], torch.full((3,), 180.0), atol=1e-3)  # 8 px squares alternate
    assert torch.allclose(image[:, 8, 8], torch.full((3,), 255.0), atol=1e-3)
    opaque = np.concatenate([_random_rgb(20, 20), np.full((20, 20, 1), 255, np.uint8)], axis=-1)
    assert torch.equal(preprocess_image(_encode(opaque), SMALL).pixel_values,
                       preprocess_image(_encode(opaque[..., :3]), SMALL).pixel_values)


def test_content_hash_follows_the_encoder_input():
    rgb = _random_rgb(40, 30, seed=5)
    png, bmp = preprocess_image(_encode(rgb), SMALL), preprocess_image(_encode(rgb, "BMP"), SMALL)
    assert png.content_hash == bmp.content_hash and len(png.content_hash) == 64  # same pixels, other container
    other = rgb.copy()
    other[0, 0, 0] ^= 1
    assert preprocess_image(_encode(other), SMALL).content_hash != png.content_hash
    shifted = MediaConfig.for_vision(VISION, max_patches=64, image_mean=(0.4, 0.5, 0.5))
    assert preprocess_image(_encode(rgb), shifted).content_hash != png.content_hash
    assert preprocess_media("video", [Image.fromarray(rgb)], SMALL).content_hash != png.content_hash


# errors ------------------------------------------------------------------------------------------
def _png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "data, config, match",
    [
        (b"not an image at all", SMALL, "cannot decode"),
        (b"", SMALL, "cannot decode"),
        (_encode(_random_rgb(64, 64))[:200], SMALL, "cannot decode"),  # truncated
        (_png_header(40, 40), SMALL, "cannot decode"),  # header without pixel data
        (_png_header(30_000, 30_000), SMALL, "pixels"),  # decompression bomb: refused before decoding
        (_encode(_random_rgb(100, 100)), MediaConfig(max_input_pixels=5000), "10000 pixels exceeds the limit of 5000"),
        (_encode(_random_rgb(100, 100)), MediaConfig(max_input_bytes=100), "exceeds the limit of 100 bytes"),
        ("a string", SMALL, "unsupported media type str"),
        (np.zeros((4, 4, 3), np.uint8), SMALL, "unsupported media type ndarray"),
    ],
)
def test_bad_images_raise_value_error(data, config, match):
    with pytest.raises(ValueError, match=match):
        preprocess_image(data, config)


def test_unsupported_media_kind():
    with pytest.raises(ValueError, match="unsupported media kind 'audio'"):
        preprocess_media("audio", b"", SMALL)


def test_data_urls():
    png = _encode(_random_rgb(8, 8))
    assert data_url_bytes("data:image/png;base64," + base64.b64encode(png).decode()) == png
    with pytest.raises(ValueError, match="only base64 data: URLs"):
        data_url_bytes("https://example.com/cat.png")
    with pytest.raises(ValueError, match="base64-encoded"):
        data_url_bytes("data:image/png,rawbytes")
    with pytest.raises(ValueError, match="not valid base64"):
        data_url_bytes("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="exceeds the limit of 10 bytes"):
        data_url_bytes("data:image/png;base64," + base64.b64encode(png).decode(), max_bytes=10)


# config ------------------------------------------------------------------------------------------
def test_media_config_from_preprocessor_config():
    published = {"media_proc_cfg": {
        "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096, "temporal_merge_kernel_size": 4, "sample_fps": 2.0,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "fixed_output_tokens": None,
    }}
    config = MediaConfig.from_preprocessor_config(published)
    assert config.max_patches == 65536 and config.image_mean == (0.5, 0.5, 0.5) and config.unit == 28
    assert MediaConfig.from_preprocessor_config({"merge_kernel_size": [2, 2]}).merge_size == 2
    assert MediaConfig() == MediaConfig.for_vision(k3_tiny_config().vision)
    with pytest.raises(ValueError, match="square"):
        MediaConfig.from_preprocessor_config({"merge_kernel_size": [2, 3]})
    with pytest.raises(ValueError, match="max_patches must be a positive int"):
        MediaConfig(max_patches=0)
    with pytest.raises(ValueError, match="exceeds the tower's 2D RoPE grid"):
        MediaConfig(max_patches_per_side=1024)
    with pytest.raises(ValueError, match="image_std must be positive"):
        MediaConfig(image_std=(0.5, 0.0, 0.5))
