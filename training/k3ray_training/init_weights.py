"""Training weights from where an earlier run left off: its `train_state.pt`, or an exported
K3-format checkpoint (a directory or a shipped name such as k3-tiny-niah) whose MXFP4 experts are
dequantised into the trainable model's dense experts (exact: every MXFP4 value is a float32)."""

from __future__ import annotations

import os

import torch

from k3ray.default_model import checkpoint_dir
from k3ray.kernels.moe.mxfp4 import dequantize_mxfp4
from k3ray.models.k3 import K3ForCausalLM
from k3ray.weights import load_model

from k3ray_training.model import niah_config, trainable_model

PACKED, SCALE = "_packed", "_scale"


def checkpoint_state(path: str) -> dict[str, torch.Tensor]:
    """A K3-format checkpoint -> a float32 state dict with dense experts (w1, w3, w2 [E, out, in])."""
    state = load_model(path, torch.float32).state_dict()
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(SCALE):
            continue
        if name.endswith(PACKED):
            stem = name[: -len(PACKED)]
            dense[stem] = dequantize_mxfp4(tensor, state[stem + SCALE], torch.float32)
        else:
            dense[name] = tensor.float()
    return dense


def initial_weights(model: K3ForCausalLM, source: str) -> None:
    """Load `source` (a train_state.pt, a checkpoint directory or a shipped checkpoint name) into
    model; the architectures must match exactly."""
    if os.path.isfile(source):
        state = torch.load(source, weights_only=True, map_location="cpu")["model"]
    else:
        path = checkpoint_dir(source)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--init-from {source!r} is neither a train_state.pt nor a checkpoint directory")
        state = checkpoint_state(path)
    want = model.state_dict()
    differ = sorted(set(want) ^ set(state)) + sorted(
        k for k in set(want) & set(state) if want[k].shape != state[k].shape)
    if differ:
        raise ValueError(f"--init-from {source!r} does not match the model ({len(differ)} tensors differ in name "
                         f"or shape, first {differ[:3]})")
    model.load_state_dict(state)


def trained_niah_model(source: str) -> K3ForCausalLM:
    """The niah-config model (fp32, eval mode) with `source`'s weights, for reading a trained run."""
    model = trainable_model(niah_config(), seed=0)
    initial_weights(model, source)
    return model.eval()
