"""Vision weights in K3's checkpoint: written with the published names and bf16 into the text
model's shards, loaded back bit-exactly by the vision loader (strictly, reading only vision shards),
still skipped by the text loader, and present in the default tiny checkpoint."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from k3ray.config import k3_tiny_config
from k3ray.default_model import DEFAULT_NAME
from k3ray.models.init import build_model
from k3ray.vision import (
    MediaConfig,
    build_vision_model,
    encode_media,
    has_vision_weights,
    load_vision,
    load_vision_checkpoint,
    preprocess_image,
)
from k3ray.weights import load_checkpoint, load_model, read_weight_map, save_checkpoint

CONFIG = k3_tiny_config()
SMALL_SHARD = 65_536


@pytest.fixture(scope="module")
def models():
    return build_model(CONFIG, torch.bfloat16, seed=1), build_vision_model(CONFIG.vision, torch.bfloat16, seed=1)


@pytest.fixture(scope="module")
def ckpt(models, tmp_path_factory):
    path = tmp_path_factory.mktemp("vision_ckpt")
    save_checkpoint(models[0], path, max_shard_bytes=SMALL_SHARD, vision=models[1])
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_index(path, edit):
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index["weight_map"])
    index_file.write_text(json.dumps(index))


def test_written_with_published_names_and_bf16(models, ckpt):
    weight_map = read_weight_map(str(ckpt))
    vision_names = set(models[1].state_dict())
    assert vision_names <= set(weight_map)
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in vision_names
    for shard in {weight_map[name] for name in vision_names}:
        for name, tensor in load_file(ckpt / shard).items():
            if name in vision_names:
                assert tensor.dtype == torch.bfloat16, name
    assert json.loads((ckpt / "config.json").read_text())["vision_config"]["vt_hidden_size"] == 64


def test_round_trip_is_bit_exact(models, ckpt):
    loaded = load_vision(ckpt, dtype=torch.bfloat16)
    expected = models[1].state_dict()
    assert loaded.config == CONFIG.vision and loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name
    as_fp32 = load_vision(ckpt, dtype=torch.float32)
    assert all(torch.equal(t, expected[n].float()) for n, t in as_fp32.state_dict().items())


def test_text_loader_skips_the_vision_tensors(models, ckpt):
    text = build_model(CONFIG, torch.bfloat16, seed=None)
    report = load_checkpoint(text, ckpt)
    assert sorted(report.skipped_vision) == sorted(models[1].state_dict())
    assert not any(name.startswith(("vision_tower.", "mm_projector.")) for name in report.loaded)
    original = models[0].state_dict()
    assert all(torch.equal(t, original[n]) for n, t in load_model(ckpt, torch.bfloat16).state_dict().items())


def test_vision_loader_opens_only_vision_shards(models, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    weight_map = read_weight_map(str(path))
    vision_shards = {weight_map[name] for name in models[1].state_dict()}
    others = set(weight_map.values()) - vision_shards
    assert others
    for shard in others:
        (path / shard).unlink()
    model = build_vision_model(CONFIG.vision, torch.bfloat16, seed=None)
    assert len(load_vision_checkpoint(model, path)) == len(models[1].state_dict())


def test_text_only_checkpoint_has_no_vision(models, tmp_path):
    save_checkpoint(models[0], tmp_path)
    assert not has_vision_weights(tmp_path)
    with pytest.raises(ValueError, match=r"missing vision keys: vision_tower\.patch_embed\.proj\.weight"):
        load_vision(tmp_path)


def test_strictness(models, ckpt, tmp_path):
    fresh = build_vision_model(CONFIG.vision, torch.bfloat16, seed=None)
    path = _copy(ckpt, tmp_path)
    _edit_index(path, lambda wm: wm.pop("mm_projector.post_norm.weight"))
    with pytest.raises(ValueError, match=r"1 missing vision keys: mm_projector\.post_norm\.weight"):
        load_vision_checkpoint(fresh, path)

    path = _copy(ckpt, tmp_path / "extra")
    save_file({"vision_tower.encoder.blocks.2.wo.weight": torch.zeros(2)}, path / "extra.safetensors")
    _edit_index(path, lambda wm: wm.update({"vision_tower.encoder.blocks.2.wo.weight": "extra.safetensors"}))
    with pytest.raises(ValueError, match=r"unexpected vision keys: vision_tower\.encoder\.blocks\.2\.wo\.weight"):
        load_vision_checkpoint(fresh, path)

    path = _copy(ckpt, tmp_path / "shape")
    name = "vision_tower.encoder.blocks.0.wo.weight"
    save_file({name: torch.zeros(64, 32, dtype=torch.bfloat16)}, path / "extra.safetensors")
    _edit_index(path, lambda wm: wm.update({name: "extra.safetensors"}))
    with pytest.raises(ValueError, match=r"wo\.weight: checkpoint shape \[64, 32\] != expected shape \[64, 64\]"):
        load_vision_checkpoint(fresh, path)


def test_writer_checks_the_vision_model(models, tmp_path):
    other = build_vision_model(dataclasses.replace(CONFIG.vision, num_layers=1), seed=0)
    with pytest.raises(ValueError, match="config must equal the text model's config.vision"):
        save_checkpoint(models[0], tmp_path, vision=other)
    text_only = build_model(CONFIG.replace(vision=None), torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="config must equal"):
        save_checkpoint(text_only, tmp_path, vision=models[1])


def test_load_vision_needs_a_vision_config(models, tmp_path):
    save_checkpoint(build_model(CONFIG.replace(vision=None), torch.bfloat16, seed=0), tmp_path)
    with pytest.raises(ValueError, match="has no vision_config"):
        load_vision(tmp_path)


def test_default_tiny_checkpoint_carries_the_tower(tiny_checkpoint):
    assert DEFAULT_NAME == "k3-tiny-v5"
    assert has_vision_weights(tiny_checkpoint)
    model = load_vision(tiny_checkpoint, dtype=torch.bfloat16)
    rgb = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    item = preprocess_image(Image.fromarray(rgb), MediaConfig.for_vision(model.config))
    out = encode_media(model, item.pixel_values, item.grid_thws)
    assert out.shape == (item.num_tokens, CONFIG.hidden_size) and torch.isfinite(out.float()).all()
    assert out.float().std() > 0.1
