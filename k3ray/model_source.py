"""What `--model` names when a command needs only the model's config (info, plan, and the
benchmarks that build random weights): a preset, a shipped checkpoint name, a checkpoint folder or
a config.json. Commands that load weights take a folder or shipped name (k3ray.checkpoints)."""

from __future__ import annotations

import argparse
import os

from k3ray.checkpoints import SHIPPED, shipped_checkpoint_dir
from k3ray.cli_flags import add_deprecated_alias
from k3ray.config import PRESETS, ModelConfig, k3_tiny_config, preset
from k3ray.default_model import DEFAULT_NAME
from k3ray.model_names import CONFIG, set_model_kind

MODEL_CONFIG_HELP = (f"a preset ({', '.join(PRESETS)}), a checkpoint name ({', '.join((DEFAULT_NAME, *SHIPPED))}), "
                     "a checkpoint folder or a config.json")


def model_config(model: str) -> ModelConfig:
    """The config `model` names (a path that exists wins over a preset or shipped name)."""
    if model in PRESETS and not os.path.exists(model):
        return preset(model)
    if model == DEFAULT_NAME and not os.path.exists(model):
        return k3_tiny_config()  # what the default checkpoint is written from
    path = shipped_checkpoint_dir(model) if model in SHIPPED and not os.path.exists(model) else model
    cfg = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(cfg):
        raise ValueError(f"--model {model!r} is not {MODEL_CONFIG_HELP}")
    return ModelConfig.from_json_file(cfg)


def add_random_model_argument(p: argparse.ArgumentParser, default: str = "k3-tiny") -> None:
    """`--model` of a benchmark that builds random weights (seed 0) from the model's config."""
    p.add_argument("--model", default=default, help=f"whose config, with random weights (seed 0): {MODEL_CONFIG_HELP}")
    add_deprecated_alias(p, "--preset", "--model", dest="model")
    set_model_kind(p, CONFIG)
