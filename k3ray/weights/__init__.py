"""K3's published safetensors checkpoints: names, loading (whole model or slice), writing."""

from k3ray.weights.checkpoint_dir import read_weight_map
from k3ray.weights.loader import LoadReport, load_checkpoint, load_model
from k3ray.weights.names import checkpoint_name, parse_checkpoint_name, published_dtype
from k3ray.weights.writer import save_checkpoint

__all__ = [
    "LoadReport",
    "checkpoint_name",
    "load_checkpoint",
    "load_model",
    "parse_checkpoint_name",
    "published_dtype",
    "read_weight_map",
    "save_checkpoint",
]
