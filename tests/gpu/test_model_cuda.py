"""The model on CUDA: tiny K3 logits in fp32 equal the CPU's within 1e-4 relative, a checkpoint
loads straight onto the GPU (MXFP4 experts packed there), and the vision tower runs there.
Skipped without CUDA; tests/gpu/run.sh runs them on a GPU host."""

import pytest
import torch

from k3ray.api import K3
from k3ray.config import preset
from k3ray.models.init import build_model
from k3ray.vision import encode_media, load_vision
from k3ray.weights import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
CUDA = torch.device("cuda", 0)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest elementwise difference over the largest magnitude."""
    return float((got.cpu().double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("preset_name", ["k3-micro", "k3-tiny"])
def test_fp32_logits_on_cuda_equal_the_cpu(preset_name):
    config = preset(preset_name)
    ids = torch.randint(0, config.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    cpu = K3(build_model(config, torch.float32, seed=0))
    gpu = K3(build_model(config, torch.float32, seed=0, device=CUDA))
    assert gpu.device == CUDA
    got = gpu.logits(ids)
    assert got.device == CUDA
    assert relative_error(got, cpu.logits(ids)) <= 1e-4
    # decode after a prefill, token by token: the decode kernels
    cpu_out = cpu.generate(ids[:40], max_new_tokens=12, stop_token_ids=[])
    assert gpu.generate(ids[:40], max_new_tokens=12, stop_token_ids=[]) == cpu_out


def test_a_checkpoint_loads_onto_the_gpu(tiny_checkpoint):
    model = load_model(tiny_checkpoint, torch.float32, device="cuda")
    state = model.state_dict()
    assert all(t.device == CUDA for t in state.values())
    packed = [t for name, t in state.items() if name.endswith("_packed")]
    assert packed and all(t.dtype == torch.uint8 for t in packed)  # MXFP4 experts stay packed
    ids = list(range(3, 90))
    got = K3.load(tiny_checkpoint, device="cuda").logits(ids)
    want = K3.load(tiny_checkpoint, device="cpu").logits(ids)
    assert relative_error(got, want) <= 1e-4


def test_the_vision_tower_runs_on_the_gpu(tiny_checkpoint):
    gpu, cpu = load_vision(tiny_checkpoint, torch.float32, "cuda"), load_vision(tiny_checkpoint, torch.float32)
    p = gpu.config.patch_size
    pixels = torch.rand(2 * 4 * 6, 3, p, p, generator=torch.Generator().manual_seed(1))
    grid = torch.tensor([[2, 4, 6]])
    got = encode_media(gpu, pixels, grid)
    assert got.device == CUDA
    assert relative_error(got, encode_media(cpu, pixels, grid)) <= 1e-4
