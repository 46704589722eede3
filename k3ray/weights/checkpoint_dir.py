"""A K3 checkpoint directory on disk (`config.json`, safetensors shards and their index) and the
strict checks every load makes, whether it fills the text model or the vision tower: the
directory and its index exist, no key is missing or unexpected, every shard file exists, and
each tensor is in its shard with the exact expected shape. `check_shard_files` reads every
shard's header only (a truncated or corrupt file, a tensor the index misplaces), in seconds."""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

from safetensors import SafetensorError, safe_open

from k3ray.config import ModelConfig

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_LISTED = 20  # names shown in an error message before "... and N more"

T = TypeVar("T")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def read_weight_map(path: str) -> dict[str, str]:
    """Checkpoint tensor name -> shard file name (relative to `path`)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f).get("weight_map")
            except (json.JSONDecodeError, AttributeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: `weight_map` must map tensor names to shard file names")
        return weight_map
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        with open_shard(single) as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise ValueError(f"{path}: holds neither {INDEX_FILE} nor {SINGLE_FILE}")


@contextlib.contextmanager
def open_shard(file: str, framework: str = "numpy", device: str = "cpu") -> Iterator:
    """safe_open(file), which checks the header (its length, its JSON, each tensor's dtype, shape
    and offsets against the file's size) and reads no tensor; a ValueError naming the file if the
    header is bad. framework "pt" reads torch tensors (importing torch); "numpy" suits the header."""
    try:
        handle = safe_open(file, framework=framework, device=device)
    except SafetensorError as e:
        raise ValueError(f"{file}: not a complete safetensors file ({e}); copy it again") from None
    with handle as f:
        yield f


def check_shard_files(path: str, weight_map: dict[str, str]) -> None:
    """Every shard file the index names exists, has a sound header (open_shard) and holds the
    tensors the index places in it; reads headers only."""
    for shard, names in sorted(group_by_shard(path, weight_map, weight_map, lambda name: name).items()):
        file = os.path.join(path, shard)
        with open_shard(file) as f:
            held = set(f.keys())
        absent = [name for name in names if name not in held]
        if absent:
            raise ValueError(f"{file} does not hold {len(absent)} tensor(s) that {INDEX_FILE} places there: "
                             f"{_listing(absent)}")


def read_config(path: str) -> ModelConfig:
    """The ModelConfig in `path/config.json`."""
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise ValueError(f"{config_file} does not exist")
    return ModelConfig.from_json_file(config_file)


def open_weight_map(path: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """The checkpoint directory as a string and its weight map, or a ValueError if it is not a directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a directory")
    return path, read_weight_map(path)


def check_keys(
    path: str, model: str, missing: list[str], unexpected: list[str], what: str = "keys", unexpected_why: str = ""
) -> None:
    """One ValueError naming every missing and unexpected `what` of the checkpoint, if there are any."""
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing {what}: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected {what}{unexpected_why}: {_listing(unexpected)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not match {model}: " + "; ".join(problems))


def group_by_shard(
    path: str, weight_map: dict[str, str], items: Iterable[T], name: Callable[[T], str]
) -> dict[str, list[T]]:
    """`items` grouped by the shard that holds each (by its checkpoint `name`), once every such shard file exists."""
    by_shard: dict[str, list[T]] = defaultdict(list)
    for item in items:
        by_shard[weight_map[name(item)]].append(item)
    for shard in by_shard:
        shard_file(path, shard)
    return dict(by_shard)


def shard_file(path: str, shard: str) -> str:
    """The path of `shard` (a file name from the index), once it exists."""
    file = os.path.join(path, shard)
    if not os.path.isfile(file):
        raise ValueError(f"shard file {file} named in {INDEX_FILE} does not exist")
    return file


def copy_from_shard(
    file: str, targets: list[tuple[str, torch.Tensor]], check_dtype: Callable[[str, torch.Tensor, torch.Tensor], None]
) -> None:
    """Copy each (checkpoint name, target tensor) of `targets` from the shard `file`, once the tensor
    is there with the target's exact shape and `check_dtype(name, tensor, target)` has not raised.
    Tensors are read one at a time straight onto the targets' device (never the whole shard)."""
    import torch  # lazy: serve's preflight reads a checkpoint's index and headers before torch loads

    device = str(targets[0][1].device) if targets else "cpu"
    with open_shard(file, "pt", device) as f, torch.no_grad():
        present = set(f.keys())
        for name, target in targets:
            if name not in present:
                raise ValueError(f"{file} does not hold {name}, which the index places there")
            shape = tuple(f.get_slice(name).get_shape())
            if shape != tuple(target.shape):
                raise ValueError(f"{name}: checkpoint shape {list(shape)} != expected shape {list(target.shape)}")
            tensor = f.get_tensor(name)
            check_dtype(name, tensor, target)
            target.copy_(tensor)
