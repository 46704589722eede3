"""Checkpoints shipped inside the package, loadable by name wherever a checkpoint directory is
taken (`K3.load`, `LLM`, `load_model`, `k3ray serve --model`, `k3ray eval --model`). This module
knows only the shipped ones (the weights loader resolves their names through it);
`k3ray.default_model.checkpoint_dir` adds the default for no model at all.

k3-tiny-niah: the tiny K3 trained for retrieval by the training program of a k3ray checkout
(`training/`, not part of the package), which exported its weights, config and tokenizer into this
folder. How it was trained (the stages' commands) and its training log are in training/README.md.

k3-tiny-vl: k3-tiny-niah grown a MoonViT-V2 tower and projector, trained by the same folder's
vision program in two stages to read the code card of `k3ray eval mm` in images and videos, then the
first of video_order's two cards; it ships its image processor settings (preprocessor_config.json)
beside config and tokenizer.
"""

from __future__ import annotations

import os
from importlib import resources

# name -> how to make it, run in a k3ray checkout's training/ folder: the programs are not installed
# (training/README.md has the stages)
TRAIN_COMMANDS = {
    "k3-tiny-niah": "cd training && python -m k3ray_training.train --out runs/k3-tiny-niah --export {path}",
    "k3-tiny-vl": "cd training && python -m k3ray_training.vision_train --out runs/k3-tiny-vl --steps 900 --export "
                  "runs/k3-tiny-vl/export && python -m k3ray_training.vision_train --out runs/k3-tiny-vl-order "
                  "--init-from runs/k3-tiny-vl/export --mix order --steps 300 --lr 3e-4 --vision-lr 1e-3 --warmup 20 "
                  "--varied-from 0 --varied-cards 0.1 --eval-every 25 --export {path}",
}
SHIPPED = tuple(TRAIN_COMMANDS)


def shipped_checkpoint_dir(name: str) -> str:
    if name not in SHIPPED:
        raise ValueError(f"no shipped checkpoint {name!r}; shipped: {', '.join(SHIPPED)}")
    path = str(resources.files("k3ray.checkpoints") / name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{name} is not in this build of k3ray; train and export it from a k3ray checkout with "
                         f"`{TRAIN_COMMANDS[name].format(path=path)}`")
    return path


def resolve_shipped(model: str | os.PathLike) -> str:
    """The directory to load: a shipped name that is not a checkpoint here (no such path, or a folder
    without a config.json, as training/k3-tiny-niah holds its log) -> its packaged directory; anything
    else as given."""
    path = os.fspath(model)
    if path in SHIPPED and not os.path.exists(os.path.join(path, "config.json")):
        return shipped_checkpoint_dir(path)
    return path
