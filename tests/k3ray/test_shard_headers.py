"""A checkpoint's tensor files are checked by their headers alone (no tensor read, no torch), before
anything loads: a truncated or corrupt shard, a shard the index names that is missing, a tensor the
index places in a shard that lacks it. Each is one ValueError naming the file; the loader raises
the same ValueError (not safetensors' own error) if it meets such a file."""

import json
import os
import pathlib
import struct
import sys

import pytest

from k3ray.weights import checkpoint_dir
from k3ray.weights.checkpoint_dir import INDEX_FILE, check_shard_files, open_weight_map


def copy_of(checkpoint: str, into: pathlib.Path) -> pathlib.Path:
    """A checkpoint whose index and shards are copies (so they can be damaged), the rest links."""
    into.mkdir()
    for f in pathlib.Path(checkpoint).iterdir():
        target = into / f.name
        if ".safetensors" in f.name:
            target.write_bytes(f.read_bytes())
        else:
            target.symlink_to(f)
    return into


def a_shard(path: pathlib.Path) -> pathlib.Path:
    return sorted(path.glob("*.safetensors"))[1]


def truncate(path: pathlib.Path) -> str:
    shard = a_shard(path)
    os.truncate(shard, shard.stat().st_size - 1000)
    return shard.name


def corrupt_header(path: pathlib.Path) -> str:
    shard = a_shard(path)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"\xff not json \x00"
    shard.write_bytes(bytes(data))
    return shard.name


def header_longer_than_file(path: pathlib.Path) -> str:
    shard = a_shard(path)
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    shard.write_bytes(bytes(data))
    return shard.name


def remove_shard(path: pathlib.Path) -> str:
    shard = a_shard(path)
    shard.unlink()
    return shard.name


def misplace_tensor(path: pathlib.Path) -> str:
    """The index moves one tensor to a shard that does not hold it."""
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (path / INDEX_FILE).unlink()
    (path / INDEX_FILE).write_text(json.dumps(index))
    return shards[1]


DAMAGES = {"truncated": (truncate, "not a complete safetensors file"),
           "corrupt header": (corrupt_header, "not a complete safetensors file"),
           "header length past the end": (header_longer_than_file, "not a complete safetensors file"),
           "shard missing": (remove_shard, "does not exist"),
           "tensor misplaced": (misplace_tensor, r"does not hold 1 tensor\(s\)")}


@pytest.fixture
def headers_only(monkeypatch):
    """safe_open whose tensors cannot be read: the check must not need one."""
    real_open = checkpoint_dir.safe_open

    class HeadersOnly:
        def __init__(self, *args, **kwargs) -> None:
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def metadata(self):
            return self.file.metadata()

        def __getattr__(self, name):  # get_tensor, get_slice, ...
            raise AssertionError(f"the header check called {name}: it reads tensors")

    monkeypatch.setattr(checkpoint_dir, "safe_open", HeadersOnly)


def test_a_sound_checkpoint_passes_without_torch(tiny_checkpoint, tmp_path):
    code = ("import sys; from k3ray.weights.checkpoint_dir import check_shard_files, open_weight_map; "
            f"check_shard_files(*open_weight_map({tiny_checkpoint!r})); print('torch' in sys.modules)")
    import subprocess

    torch_imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                    timeout=120, cwd=tmp_path).stdout.strip()
    assert torch_imported == "False"


def test_a_sound_checkpoint_passes_reading_headers_only(tiny_checkpoint, headers_only):
    check_shard_files(*open_weight_map(tiny_checkpoint))


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_one_value_error_naming_the_file(tiny_checkpoint, tmp_path, damage, headers_only):
    path = copy_of(tiny_checkpoint, tmp_path / "ckpt")
    damage_it, words = DAMAGES[damage]
    file = damage_it(path)
    with pytest.raises(ValueError, match=words) as raised:
        check_shard_files(*open_weight_map(path))
    assert file in str(raised.value) and len(str(raised.value).splitlines()) == 1


def test_the_loader_names_a_truncated_file_too(tiny_checkpoint, tmp_path):
    from k3ray.weights import load_model

    path = copy_of(tiny_checkpoint, tmp_path / "ckpt")
    file = truncate(path)
    with pytest.raises(ValueError, match=f"{file}: not a complete safetensors file"):
        load_model(path)
