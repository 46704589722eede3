"""K3's published safetensors checkpoints: names, loading (whole model or slice), writing.

The names below are imported on first use: `k3ray serve` checks a checkpoint's index and headers
(checkpoint_dir) in a fraction of a second, without importing torch for the loader and writer."""

import importlib

_HOME = {
    "LoadReport": "loader",
    "checkpoint_name": "names",
    "load_checkpoint": "loader",
    "load_model": "loader",
    "parse_checkpoint_name": "names",
    "published_dtype": "names",
    "read_weight_map": "checkpoint_dir",
    "save_checkpoint": "writer",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
