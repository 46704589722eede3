"""Write a trained model as a K3-format checkpoint: bf16 tensors (the published fp32 ones in
fp32), routed experts quantised to MXFP4 and the byte tokenizer. The training log stays in the run
folder: a checkpoint exported into the package ships only what loading it needs."""

from __future__ import annotations

from pathlib import Path

import torch

from k3ray.kernels.moe.mxfp4 import quantize_mxfp4
from k3ray.models.k3 import K3ForCausalLM
from k3ray.models.moe import PROJECTIONS, LocalExperts
from k3ray.tokenizer import ByteTokenizer
from k3ray.weights import save_checkpoint


@torch.no_grad()
def quantized_copy(model: K3ForCausalLM) -> K3ForCausalLM:
    """The same model with MXFP4 experts (each expert's [out, in] weight quantised in groups of 32)."""
    mx = K3ForCausalLM(model.config.replace(expert_format="mxfp4"), dtype=torch.float32)
    dense = {name: t.cpu() for name, t in model.state_dict().items()}  # a model trained on a GPU too
    mx.load_state_dict({k: v for k, v in dense.items() if k in mx.state_dict()}, strict=False)
    for name, mod in mx.named_modules():
        if isinstance(mod, LocalExperts):
            for proj in PROJECTIONS:
                packed, scale = getattr(mod, f"{proj}_packed"), getattr(mod, f"{proj}_scale")
                for e, w in enumerate(dense[f"{name}.{proj}"]):
                    packed[e], scale[e] = quantize_mxfp4(w.float())
    missing = set(mx.state_dict()) - set(dense) - {
        k for k in mx.state_dict() if k.endswith(("_packed", "_scale"))}
    assert not missing, f"tensors without a trained value: {sorted(missing)[:3]}"
    return mx.eval()


def export_checkpoint(model: K3ForCausalLM, path: str | Path) -> Path:
    path = Path(path)
    save_checkpoint(quantized_copy(model), path)
    ByteTokenizer(model.config.vocab_size).save_pretrained(path)
    return path
