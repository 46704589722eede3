"""Checkpoint names, writer and loader on k3-tiny: bit-exact round trips in the published layout
(MXFP4 and bf16 experts), float32 loading, multi-shard and single-file checkpoints, slices that
read only their own tensors, strictness errors, and identical logits after a round trip."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3ray.config import preset
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.init import build_model
from k3ray.weights import (
    checkpoint_dir,
    checkpoint_name,
    load_checkpoint,
    load_model,
    parse_checkpoint_name,
    published_dtype,
    read_weight_map,
    save_checkpoint,
)
from k3ray.weights.names import model_tensor_refs

SMALL_SHARD = 65_536  # bytes: k3-tiny (about 1 MB published) spreads over a dozen or more shards
FORMATS = ["mxfp4", "bf16"]
SLICE_LAYERS, SLICE_EXPERTS = (3, 6), (2, 5)
EXPERTS = "language_model.model.layers.{}.block_sparse_moe.experts.{}."


def _config(fmt: str):
    return preset("k3-tiny").replace(expert_format=fmt)


@pytest.fixture(scope="module", params=FORMATS)
def original(request):
    """A bf16 model (so the published bf16 / fp32 / uint8 dtypes hold it losslessly)."""
    return build_model(_config(request.param), torch.bfloat16, seed=3)


@pytest.fixture(scope="module")
def ckpt(original, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"ckpt_{original.config.expert_format}")
    shards = save_checkpoint(original, path, max_shard_bytes=SMALL_SHARD)
    assert len(shards) > 5
    return path


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def _edit_index(path, edit) -> None:
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index["weight_map"])
    index_file.write_text(json.dumps(index))


def _add_tensors(path, tensors: dict) -> None:
    save_file(tensors, path / "extra.safetensors")
    _edit_index(path, lambda wm: wm.update({name: "extra.safetensors" for name in tensors}))


def _assert_state_equal(model, expected: dict) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


# names ---------------------------------------------------------------------------------------
def test_name_table_round_trips(original):
    refs = model_tensor_refs(original, 0)
    names = [ref.checkpoint for ref in refs]
    assert len(set(names)) == len(names)
    for ref in refs:
        assert checkpoint_name(ref.param, ref.expert) == ref.checkpoint
        assert parse_checkpoint_name(ref.checkpoint) == (ref.param, ref.expert)
    fmt = original.config.expert_format
    leaf = "w2.weight_packed" if fmt == "mxfp4" else "w2.weight"
    stacked = "w2_packed" if fmt == "mxfp4" else "w2"
    assert EXPERTS.format(4, 7) + leaf in names
    assert parse_checkpoint_name(EXPERTS.format(4, 7) + leaf) == (f"model.layers.4.block_sparse_moe.experts.{stacked}", 7)
    assert "language_model.lm_head.weight" in names
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in names
    assert parse_checkpoint_name("vision_tower.patch_embed.proj.weight") is None


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("language_model.model.layers.0.self_attn.A_log", torch.float32),
        ("language_model.model.layers.0.self_attn.dt_bias", torch.float32),
        ("language_model.model.layers.2.self_attn.k_conv1d.weight", torch.float32),
        ("language_model.model.layers.2.self_attn.o_norm.weight", torch.float32),
        ("language_model.model.layers.5.block_sparse_moe.gate.e_score_correction_bias", torch.float32),
        ("language_model.model.layers.5.block_sparse_moe.gate.weight", torch.bfloat16),
        ("language_model.model.layers.5.block_sparse_moe.experts.3.w1.weight_packed", torch.uint8),
        ("language_model.model.layers.5.block_sparse_moe.experts.3.w1.weight_scale", torch.uint8),
        ("language_model.model.layers.5.block_sparse_moe.experts.3.w1.weight", torch.bfloat16),
        ("language_model.model.layers.3.self_attn.q_a_layernorm.weight", torch.bfloat16),
        ("language_model.model.embed_tokens.weight", torch.bfloat16),
        ("language_model.lm_head.weight", torch.bfloat16),
    ],
)
def test_published_dtype_map(name, dtype):
    assert published_dtype(name) == dtype


# writer --------------------------------------------------------------------------------------
def test_written_files_use_published_layout(original, ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    assert set(weight_map) == {ref.checkpoint for ref in model_tensor_refs(original, 0)}
    total = 0
    for shard in shards:
        tensors = load_file(ckpt / shard)
        assert {n for n, s in weight_map.items() if s == shard} == set(tensors)
        for name, tensor in tensors.items():
            assert tensor.dtype == published_dtype(name), name
            total += tensor.numel() * tensor.element_size()
    assert index["metadata"]["total_size"] == total
    c = original.config
    I, Dl = c.moe_intermediate_size, c.routed_expert_hidden_size
    w1 = EXPERTS.format(1, 0) + ("w1.weight_packed" if c.expert_format == "mxfp4" else "w1.weight")
    with safe_open(ckpt / weight_map[w1], framework="pt") as f:
        assert f.get_slice(w1).get_shape() == ([I, Dl // 2] if c.expert_format == "mxfp4" else [I, Dl])
    assert json.loads((ckpt / "config.json").read_text()) == c.to_hf()


def test_writer_casts_float32_model_to_published_dtypes(tmp_path):
    model = build_model(_config("mxfp4"), torch.float32, seed=1)
    (shard,) = save_checkpoint(model, tmp_path)
    assert shard == "model-00001-of-00001.safetensors"
    with safe_open(tmp_path / shard, framework="pt") as f:
        for name in f.keys():
            assert f.get_tensor(name).dtype == published_dtype(name), name
        q = f.get_tensor("language_model.model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, model.model.layers["0"].self_attn.q_proj.weight.detach().to(torch.bfloat16))


def test_writer_refuses_a_slice(tmp_path):
    stage = build_model(_config("mxfp4"), torch.bfloat16, seed=0, layer_range=(0, 4))
    with pytest.raises(ValueError, match="whole model"):
        save_checkpoint(stage, tmp_path)
    experts = build_model(_config("mxfp4"), torch.bfloat16, seed=0, expert_range=(0, 4))
    with pytest.raises(ValueError, match="whole model"):
        save_checkpoint(experts, tmp_path)


# loader: round trips -------------------------------------------------------------------------
def test_round_trip_is_bit_exact(original, ckpt):
    loaded = load_model(ckpt, dtype=torch.bfloat16)
    assert loaded.config.layer_types == original.config.layer_types
    assert loaded.config.expert_format == original.config.expert_format
    _assert_state_equal(loaded, original.state_dict())


def test_float32_model_gets_the_bf16_values(original, ckpt):
    loaded = load_model(ckpt, dtype=torch.float32)
    expected = {
        name: t if t.dtype in (torch.uint8, torch.float32) else t.float()
        for name, t in original.state_dict().items()
    }
    _assert_state_equal(loaded, expected)


def test_single_file_checkpoint(original, ckpt, tmp_path):
    merged = {}
    for shard in set(read_weight_map(str(ckpt)).values()):
        merged.update(load_file(ckpt / shard))
    save_file(merged, tmp_path / "model.safetensors")
    model = build_model(original.config, torch.bfloat16, seed=None)
    report = load_checkpoint(model, tmp_path)
    assert report.shards == ("model.safetensors",)
    assert len(report.loaded) == len(merged)
    _assert_state_equal(model, original.state_dict())


def test_logits_after_round_trip(original, ckpt):
    loaded = load_model(ckpt, dtype=torch.bfloat16)
    c, T = original.config, 11
    ids = torch.randint(0, c.vocab_size, (T,), generator=torch.Generator().manual_seed(0))

    def logits(model):
        cache = ModelCache.allocate(c, num_state_slots=1, num_blocks=1, block_size=16, dtype=torch.bfloat16)
        batch = ForwardBatch(torch.tensor([0, T]), torch.tensor([T]), torch.tensor([0]), torch.tensor([[0]]), cache)
        with torch.no_grad():
            return model(ids, batch)

    expected = logits(original)
    assert expected.std() > 0.1
    assert torch.equal(logits(loaded), expected)


# loader: slices ------------------------------------------------------------------------------
def _slice_names(model) -> set[str]:
    return {ref.checkpoint for ref in model_tensor_refs(model, model.expert_range[0])}


def test_slice_equals_the_full_model(original, ckpt):
    part = load_model(ckpt, dtype=torch.bfloat16, layer_range=SLICE_LAYERS, expert_range=SLICE_EXPERTS)
    full = original.state_dict()
    e0, e1 = SLICE_EXPERTS
    expected = {
        name: full[name][e0:e1] if ".experts." in name else full[name] for name in part.state_dict()
    }
    assert any(".layers.5.block_sparse_moe.experts." in name for name in expected)
    assert not any(name.startswith(("model.embed_tokens", "lm_head", "model.norm")) for name in expected)
    _assert_state_equal(part, expected)


class _RecordingOpen:
    """Wraps safetensors.safe_open, recording every file opened and every tensor read."""

    def __init__(self):
        self.files, self.read = [], []

    def __call__(self, file, framework, **kw):
        self.files.append(os.path.basename(file))
        return _RecordingHandle(safe_open(file, framework=framework, **kw), self.read)


class _RecordingHandle:
    def __init__(self, handle, read):
        self.handle, self.read = handle, read

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name):
        return self.handle.get_slice(name)

    def get_tensor(self, name):
        self.read.append(name)
        return self.handle.get_tensor(name)


def test_slice_reads_only_its_tensors(original, ckpt, tmp_path, monkeypatch):
    path = _copy(ckpt, tmp_path)
    weight_map = read_weight_map(str(path))
    part = build_model(original.config, torch.bfloat16, seed=None, layer_range=SLICE_LAYERS, expert_range=SLICE_EXPERTS)
    needed = _slice_names(part)
    needed_shards = {weight_map[n] for n in needed}
    other_shards = set(weight_map.values()) - needed_shards
    assert len(other_shards) >= 3
    for shard in other_shards:  # shards of other layers only: the slice must not need them
        os.remove(path / shard)

    recorder = _RecordingOpen()
    monkeypatch.setattr(checkpoint_dir, "safe_open", recorder)
    report = load_checkpoint(part, path)

    assert sorted(recorder.read) == sorted(needed) == sorted(report.loaded)
    assert set(recorder.files) == needed_shards and len(recorder.files) == len(needed_shards)
    for name in recorder.read:
        layer = int(name.split(".layers.")[1].split(".")[0])
        assert SLICE_LAYERS[0] <= layer < SLICE_LAYERS[1], name
        if ".experts." in name:
            expert = int(name.split(".experts.")[1].split(".")[0])
            assert SLICE_EXPERTS[0] <= expert < SLICE_EXPERTS[1], name
    assert report.num_outside_slice == len(weight_map) - len(needed)
    full = original.state_dict()
    assert torch.equal(part.state_dict()["model.layers.4.self_attn.q_proj.weight"], full["model.layers.4.self_attn.q_proj.weight"])


# loader: strictness --------------------------------------------------------------------------
def _fresh(original, **kw):
    return build_model(original.config, torch.bfloat16, seed=None, **kw)


def test_missing_key(original, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    gone = "language_model.model.layers.2.self_attn.A_log"
    _edit_index(path, lambda wm: wm.pop(gone))
    with pytest.raises(ValueError, match=r"1 missing keys: language_model\.model\.layers\.2\.self_attn\.A_log"):
        load_checkpoint(_fresh(original), path)
    # a slice that does not hold layer 2 does not need it
    load_checkpoint(_fresh(original, layer_range=SLICE_LAYERS), path)


def test_missing_expert_key(original, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    leaf = "w3.weight_scale" if original.config.expert_format == "mxfp4" else "w3.weight"
    gone = EXPERTS.format(7, 6) + leaf
    _edit_index(path, lambda wm: wm.pop(gone))
    with pytest.raises(ValueError, match="missing keys: " + gone.replace(".", r"\.")):
        load_checkpoint(_fresh(original), path)
    load_checkpoint(_fresh(original, expert_range=SLICE_EXPERTS), path)


@pytest.mark.parametrize(
    "extra",
    [
        "language_model.model.layers.0.self_attn.bogus.weight",
        "language_model.model.layers.9.input_layernorm.weight",  # k3-tiny has 9 layers
        "language_model.model.layers.0.block_sparse_moe.gate.weight",  # layer 0 is dense
        EXPERTS.format(1, 8) + "w1.weight_packed",  # k3-tiny has 8 experts
        EXPERTS.format(1, 0) + "w4.weight",
        "model.norm.weight",  # missing the language_model. prefix
    ],
)
def test_unexpected_key(original, ckpt, tmp_path, extra):
    path = _copy(ckpt, tmp_path)
    _add_tensors(path, {extra: torch.zeros(4)})
    with pytest.raises(ValueError, match="1 unexpected keys .*: " + extra.replace(".", r"\.")):
        load_checkpoint(_fresh(original), path)
    with pytest.raises(ValueError, match="unexpected keys"):  # a slice is as strict about foreign keys
        load_checkpoint(_fresh(original, layer_range=SLICE_LAYERS, expert_range=SLICE_EXPERTS), path)


def test_expert_format_mismatch_is_unexpected(original, ckpt):
    other = "bf16" if original.config.expert_format == "mxfp4" else "mxfp4"
    model = build_model(_config(other), torch.bfloat16, seed=None)
    with pytest.raises(ValueError, match="missing keys.*unexpected keys"):
        load_checkpoint(model, ckpt)


def test_vision_keys_are_skipped(original, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    vision = ["vision_tower.patch_embed.proj.weight", "mm_projector.post_norm.weight"]
    _add_tensors(path, {name: torch.zeros(3) for name in vision})
    model = _fresh(original)
    report = load_checkpoint(model, path)
    assert sorted(report.skipped_vision) == sorted(vision)
    assert report.num_outside_slice == 0
    assert "extra.safetensors" not in report.shards
    _assert_state_equal(model, original.state_dict())


def test_wrong_shape(original, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    name = "language_model.model.layers.3.self_attn.q_b_proj.weight"
    _add_tensors(path, {name: torch.zeros(5, 24, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"q_b_proj\.weight: checkpoint shape \[5, 24\] != expected shape \[48, 24\]"):
        load_checkpoint(_fresh(original), path)


def test_wrong_expert_shape(original, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    fmt = original.config.expert_format
    name = EXPERTS.format(2, 3) + ("w2.weight_scale" if fmt == "mxfp4" else "w2.weight")
    bad = torch.zeros(32, 2, dtype=torch.uint8 if fmt == "mxfp4" else torch.bfloat16)
    expected = r"\[32, 1\]" if fmt == "mxfp4" else r"\[32, 32\]"
    _add_tensors(path, {name: bad})
    with pytest.raises(ValueError, match=r"w2\.weight\w*: checkpoint shape \[32, 2\] != expected shape " + expected):
        load_checkpoint(_fresh(original), path)


def test_missing_shard_file(original, ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    shard = read_weight_map(str(path))["language_model.lm_head.weight"]
    os.remove(path / shard)
    with pytest.raises(ValueError, match=f"shard file .*{shard} named in .* does not exist"):
        load_checkpoint(_fresh(original), path)


def test_directory_problems(original, ckpt, tmp_path):
    with pytest.raises(ValueError, match="config.json does not exist"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(ValueError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="is not a directory"):
        load_checkpoint(_fresh(original), tmp_path / "absent")
