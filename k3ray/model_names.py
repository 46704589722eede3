"""The names `--model` knows, checked by the CLI before a command imports torch: a typo ends in a
moment with the names it could have meant, not seconds later at a missing config.json.

A bare name (no path separator, not starting with `~` or `.`) that is no file or folder here must
be a known name; a path is left to the command, which names it when it is missing. Which names a
command takes is its parser's default for KIND_DEST: CHECKPOINT (the default: the tiny K3's name,
a shipped checkpoint) or CONFIG (those, and the presets: commands that read only a config)."""

from __future__ import annotations

import argparse
import difflib
import os

from k3ray.checkpoints import SHIPPED
from k3ray.config import PRESETS
from k3ray.default_model import DEFAULT_NAME

CHECKPOINT = "checkpoint"
CONFIG = "config"
KIND_DEST = "_model_kind"  # parser default: which names the command's --model takes


def set_model_kind(p: argparse.ArgumentParser, kind: str) -> None:
    """Mark the command of parser `p` as taking `kind`'s names for --model."""
    if kind not in (CHECKPOINT, CONFIG):
        raise ValueError(f"kind must be {CHECKPOINT!r} or {CONFIG!r}, got {kind!r}")
    p.set_defaults(**{KIND_DEST: kind})


def known_names(kind: str = CHECKPOINT) -> tuple[str, ...]:
    checkpoints = (DEFAULT_NAME, *SHIPPED)
    return (*PRESETS, *checkpoints) if kind == CONFIG else checkpoints


def looks_like_path(model: str) -> bool:
    separators = [s for s in (os.sep, os.altsep) if s]
    return model.startswith(("~", ".")) or any(s in model for s in separators)


def check_model_name(model: str, kind: str = CHECKPOINT) -> None:
    """A ValueError naming the known names (and the closest) if `model` is a bare name that is
    neither a file or folder here nor one of them."""
    names = known_names(kind)
    if model in names or looks_like_path(model) or os.path.exists(model):
        return
    close = difflib.get_close_matches(model, names, n=1)
    listed = ([f"{', '.join(PRESETS)} (presets)"] if kind == CONFIG else []) + [
        f"{DEFAULT_NAME} (the default tiny K3)", f"{', '.join(SHIPPED)} (shipped)"]
    preset = (f"; {model} is a preset, which only info, plan and the benchmarks that build random weights take"
              if kind == CHECKPOINT and model in PRESETS else "")
    hint = f"; did you mean {close[0]}?" if close and not preset else ""
    raise ValueError(f"--model {model!r} is no file or folder here and not a model k3ray knows: "
                     f"{'; '.join(listed)}{preset}{hint}")


def check_model_argument(args: argparse.Namespace) -> None:
    """check_model_name on a parsed command's --model, when it has one and it was given."""
    model = getattr(args, "model", None)
    if isinstance(model, str):
        check_model_name(model, getattr(args, KIND_DEST, CHECKPOINT))
