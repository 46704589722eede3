"""Checkpoint names and dtypes of K3's published safetensors <-> k3ray model tensors.

A checkpoint name is `language_model.` + the model's state_dict name, except routed experts:
the checkpoint holds one tensor per expert (`...experts.{e}.w1.weight_packed`) where the model
stacks the experts it holds (`...experts.w1_packed` [E_local, out, in/2], experts from
`model.expert_range[0]`). Both directions are driven by the tables below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

CHECKPOINT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # the MoonViT tower; not part of the text model
EXPERTS_MODULE = "block_sparse_moe.experts"

# stacked model tensor under `...block_sparse_moe.experts` -> per-expert checkpoint tensor
EXPERT_TENSORS = {
    "w1_packed": "w1.weight_packed",
    "w1_scale": "w1.weight_scale",
    "w3_packed": "w3.weight_packed",
    "w3_scale": "w3.weight_scale",
    "w2_packed": "w2.weight_packed",
    "w2_scale": "w2.weight_scale",
    "w1": "w1.weight",
    "w3": "w3.weight",
    "w2": "w2.weight",
}
_STACKED_BY_CHECKPOINT = {ckpt: stacked for stacked, ckpt in EXPERT_TENSORS.items()}

# published dtypes, matched on the trailing dotted components of the checkpoint name
FP32_TENSORS = (
    "A_log",
    "dt_bias",
    "q_conv1d.weight",
    "k_conv1d.weight",
    "v_conv1d.weight",
    "o_norm.weight",
    "gate.e_score_correction_bias",
)
UINT8_TENSORS = ("weight_packed", "weight_scale")  # MXFP4 E2M1 nibbles and E8M0 scales

_EXPERT_NAME = re.compile(
    rf"^(?P<module>.+\.{re.escape(EXPERTS_MODULE)})\.(?P<expert>\d+)\.(?P<leaf>w[123]\.weight(?:_packed|_scale)?)$"
)


@dataclass(frozen=True)
class TensorRef:
    """One checkpoint tensor and where it lives in a model: `param[local]` for an expert."""

    checkpoint: str
    param: str
    expert: int | None = None  # global expert id
    local: int | None = None  # index into the stacked model tensor


def _has_suffix(name: str, suffixes: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in suffixes)


def published_dtype(checkpoint_name: str) -> torch.dtype:
    if _has_suffix(checkpoint_name, UINT8_TENSORS):
        return torch.uint8
    if _has_suffix(checkpoint_name, FP32_TENSORS):
        return torch.float32
    return torch.bfloat16


def is_vision_name(checkpoint_name: str) -> bool:
    return checkpoint_name.startswith(VISION_PREFIXES)


def _split_stacked(param: str) -> tuple[str, str] | None:
    """`...experts.w1_packed` -> (`...experts`, `w1_packed`); None for any other tensor."""
    module, _, leaf = param.rpartition(".")
    if module.endswith("." + EXPERTS_MODULE) and leaf in EXPERT_TENSORS:
        return module, leaf
    return None


def checkpoint_name(param: str, expert: int | None = None) -> str:
    """The checkpoint name of model tensor `param` (of global expert `expert` if stacked)."""
    stacked = _split_stacked(param)
    if (stacked is None) != (expert is None):
        raise ValueError(f"{param!r}: an expert id is needed exactly for stacked expert tensors, got {expert!r}")
    if stacked is None:
        return CHECKPOINT_PREFIX + param
    module, leaf = stacked
    return f"{CHECKPOINT_PREFIX}{module}.{expert}.{EXPERT_TENSORS[leaf]}"


def parse_checkpoint_name(name: str) -> tuple[str, int | None] | None:
    """Inverse of `checkpoint_name`: (model tensor name, global expert id or None); None if the
    name is not under `language_model.`. The model tensor may still not exist."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    rest = name[len(CHECKPOINT_PREFIX):]
    m = _EXPERT_NAME.match(rest)
    if m is None:
        return rest, None
    return f"{m['module']}.{_STACKED_BY_CHECKPOINT[m['leaf']]}", int(m["expert"])


def is_stacked(param: str) -> bool:
    return _split_stacked(param) is not None


def model_tensor_refs(model: nn.Module, expert_start: int) -> list[TensorRef]:
    """Every checkpoint tensor `model` holds, in state_dict order (experts expanded in id order).
    Stacked expert tensors hold experts [expert_start, expert_start + len)."""
    refs = []
    for param, tensor in model.state_dict().items():
        if not is_stacked(param):
            refs.append(TensorRef(checkpoint_name(param), param))
            continue
        for local in range(tensor.shape[0]):
            expert = expert_start + local
            refs.append(TensorRef(checkpoint_name(param, expert), param, expert, local))
    return refs
