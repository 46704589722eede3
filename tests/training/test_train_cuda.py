"""k3-tiny-niah's training step on CUDA (`python -m k3ray_training.train --device cuda`) gives the CPU's
losses, gradients and expert loads, with every auxiliary loss on (their index tensors travel to the GPU)."""

import random

import pytest
import torch

from k3ray.tokenizer import ByteTokenizer
from k3ray_training import data
from k3ray_training.model import niah_config, trainable_model
from k3ray_training.train import accumulate_step

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
AUXILIARY = {"copy_weight": 0.3, "gather_weight": 0.5, "contrast_weight": 0.5, "match_weight": 1.0,
             "route_weight": 1.0, "self_weight": 0.5, "readout_weight": 1.0, "gather_layer": 2}


@pytest.fixture
def exact_fp32():
    """No TF32 in cuBLAS or cuDNN (the short conv): fp32 on both sides, so only summation order differs."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_a_training_step_on_cuda_equals_the_cpu(exact_fp32):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tok, rng = ByteTokenizer(), random.Random(1)
    items = [data.make_example(task, 200, rng, tok) for task in ("copy", "recall", "niah", "niah_multikey_1", "recall_is")]
    digits = torch.tensor(tok.encode("0123456789"))
    runs = []
    for device in ("cpu", "cuda"):
        model = trainable_model(niah_config(), seed=0).to(device)
        loads: dict[int, torch.Tensor] = {}
        step = accumulate_step(model, items, tok.pad_token_id, 0.1, digits, loads, **AUXILIARY)
        grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
        runs.append((step, grads, loads))
    (cpu, cpu_grads, cpu_loads), (gpu, gpu_grads, gpu_loads) = runs
    assert cpu.readout_loss > 0 and cpu.route_loss >= 0 and cpu.match_loss > 0  # every term ran
    for name in ("loss", "lm_loss", "copy_loss", "gather_loss", "contrast_loss", "match_loss", "route_loss",
                 "self_loss", "readout_loss"):
        assert getattr(gpu, name) == pytest.approx(getattr(cpu, name), rel=1e-4, abs=1e-6), name
    assert cpu_grads.keys() == gpu_grads.keys()
    for name, want in cpu_grads.items():  # fp32 summation order: relative to the tensor's norm
        assert (gpu_grads[name] - want).norm() <= 1e-3 * want.norm() + 1e-7, name
    assert {k: v.tolist() for k, v in gpu_loads.items()} == {k: v.tolist() for k, v in cpu_loads.items()}
