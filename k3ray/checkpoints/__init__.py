"""Checkpoints shipped inside the package, loadable by name wherever a checkpoint directory is
taken (`K3.load`, `LLM`, `load_model`, `k3ray serve --model`, `k3ray eval --model`).

k3-tiny-niah: the tiny K3 trained for retrieval by `python -m k3ray.evals.fixture.train`, exported
into this folder with its training log beside the weights (`train_log.jsonl`: each stage's start
line holds its arguments). The shipped one took nine stages, each from the last one's state
(about three hours on 2 shared CPU cores); stages copyA to F ran at commit e6c37e3 (a recall item
then asked one key), G to I at 1452e22 (every key asked, bare form only), J at fd89277:

    train --out R/copyA --tasks copy=1 --steps 260 --stop-at 240 --tokens-per-step 800 --lr 1e-3 --warmup 10
    train --out R/stageB --init-from R/copyA/train_state.pt --steps 220 --lr 1e-3 --warmup 5 \
          --tasks niah=0.35,niah_multikey_1=0.25,niah_single_1=0.1,copy=0.3
    train --out R/stageC --init-from R/stageB/train_state.pt --steps 160 --lr 1e-3 --warmup 5 \
          --tasks niah=0.35,niah_multikey_1=0.3,niah_single_1=0.1,copy=0.25
    train --out R/stageD --init-from R/stageC/train_state.pt --steps 120 --lr 7e-4 --warmup 5 \
          --tasks niah=0.4,niah_multikey_1=0.35,niah_single_1=0.1,copy=0.15
    train --out R/stageF --init-from R/stageD/train_state.pt --steps 360 --lr 7e-4 --warmup 5 --seed 11 \
          --eval-every 60 --tasks recall=0.3,niah_multikey_1=0.35,niah=0.2,niah_single_1=0.05,copy=0.1
    train --out R/stageG --init-from R/stageF/train_state.pt --steps 480 --stop-at 300 --lr 1e-3 --warmup 5 \
          --seed 12 --eval-every 40 --tasks recall=0.45,niah_multikey_1=0.3,niah=0.15,niah_single_1=0.05,copy=0.05
    train --out R/stageH --init-from R/stageG/train_state.pt --steps 480 --lr 1e-3 --warmup 5 --seed 13 \
          --eval-every 40 --lm-weight 0.2 --tasks recall=0.4,niah_multikey_1=0.35,niah=0.15,niah_single_1=0.05,copy=0.05
    train --out R/stageI --init-from R/stageH/train_state.pt --steps 840 --stop-at 450 --lr 1e-3 --warmup 5 \
          --seed 14 --eval-every 60 --lm-weight 0.2 \
          --tasks recall=0.4,niah_multikey_1=0.38,niah=0.12,niah_single_1=0.05,copy=0.05
    train --out R/stageJ --init-from R/stageI/train_state.pt --steps 600 --lr 1e-3 --warmup 5 --seed 15 \
          --eval-every 60 --lm-weight 0.2 --tasks recall=0.45,niah_multikey_1=0.35,niah=0.12,niah_single_1=0.04,copy=0.04 \
          --export <this folder>/k3-tiny-niah

(G and I were stopped by hand at those steps, which is what --stop-at does; the log holds their lines
up to there.)
"""

from __future__ import annotations

import os
from importlib import resources

SHIPPED = ("k3-tiny-niah",)
TRAIN_COMMAND = "python -m k3ray.evals.fixture.train --out runs/k3-tiny-niah --export {path}"


def shipped_checkpoint_dir(name: str) -> str:
    if name not in SHIPPED:
        raise ValueError(f"no shipped checkpoint {name!r}; shipped: {', '.join(SHIPPED)}")
    path = str(resources.files("k3ray.checkpoints") / name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{name} is not in this build of k3ray; train and export it with "
                         f"`{TRAIN_COMMAND.format(path=path)}`")
    return path


def checkpoint_dir(model: str | os.PathLike | None) -> str:
    """The directory to load: None -> the default tiny checkpoint (written on first use); a shipped
    name that is not an existing path -> its packaged directory; anything else as given."""
    if model is None:
        from k3ray.default_model import default_checkpoint_dir

        return default_checkpoint_dir()
    path = os.fspath(model)
    if path in SHIPPED and not os.path.exists(path):
        return shipped_checkpoint_dir(path)
    return path
