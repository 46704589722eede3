"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`) against compressed-tensors 0.20.0 and the
transformers GPT-OSS dequantiser. Every comparison is exact: E2M1 values times a power-of-two
scale are representable in fp32 and bf16."""

import pytest
import torch
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

from k3ray.kernels.moe.mxfp4 import E2M1_VALUES, GROUP, dequantize_mxfp4, quantize_mxfp4, unpack_fp4

# K3's published quantization_config group_0 weights
K3_ARGS = QuantizationArgs(
    num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype=torch.uint8
)
K3_SCHEME = QuantizationScheme(targets=["Linear"], weights=K3_ARGS)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_mxfp4(out: int, inp: int, seed: int, lo: int = 0, hi: int = 255) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    packed = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(lo, hi, (out, inp // GROUP), dtype=torch.uint8, generator=g)
    return packed, scale


def _their_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pieces by hand, in fp32: unpack nibbles, E8M0 -> float, broadcast per group."""
    m, n = packed.shape[0], packed.shape[1] * 2
    vals = unpack_fp4_from_uint8(packed, m, n, dtype=torch.float32)
    return vals * decompress_mx_scale(scale).float().repeat_interleave(GROUP, -1)


def _exact_e2m1_weight(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights that are E2M1 values times 2^e per block, each block's |max| being 4 or 6 times 2^e
    (so the OCP scale is exactly 2^e); returns (weight, expected E8M0 codes)."""
    g = _gen(seed)
    table = torch.tensor(E2M1_VALUES)
    vals = table[torch.randint(0, 8, (out, inp), generator=g)]
    vals = vals * torch.where(torch.rand(out, inp, generator=g) < 0.5, -1.0, 1.0)
    blocks = vals.view(out, inp // GROUP, GROUP)
    blocks[..., 0] = torch.where(torch.rand(out, inp // GROUP, generator=g) < 0.5, 4.0, -6.0)
    exp = torch.randint(-20, 20, (out, inp // GROUP), generator=g)
    w = (blocks * torch.exp2(exp.float())[..., None]).view(out, inp)
    return w, (exp + 127).to(torch.uint8)


# dequantisation ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dequant_matches_compressed_tensors_decompressor(dtype):
    # every byte value and every finite E8M0 code (255 is NaN in OCP MX)
    packed, scale = _random_mxfp4(96, 256, seed=0, lo=0, hi=255)
    packed[0, :128] = torch.arange(256, dtype=torch.uint8).view(-1, 2)[:, 0]
    packed[1, :128] = torch.arange(256, dtype=torch.uint8).view(-1, 2)[:, 1]
    scale.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    theirs = MXFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale}, K3_SCHEME)["weight"]
    assert theirs.dtype == torch.bfloat16
    ours = dequantize_mxfp4(packed, scale, dtype)
    assert torch.equal(ours.to(torch.bfloat16), theirs)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), _their_dequant(packed, scale))


def test_unpack_of_compressed_tensors_packing():
    g = _gen(1)
    table = torch.tensor(E2M1_VALUES)
    vals = table[torch.randint(0, 8, (16, 64), generator=g)] * torch.where(torch.rand(16, 64, generator=g) < 0.5, -1.0, 1.0)
    packed = pack_fp4_to_uint8(vals)
    assert torch.equal(unpack_fp4(packed), vals)
    scales = torch.exp2(torch.randint(-30, 30, (16, 64 // GROUP), generator=g).float())
    packed_scale = compress_mx_scale(scales, torch.uint8)
    expected = vals * scales.repeat_interleave(GROUP, -1)
    assert torch.equal(dequantize_mxfp4(packed, packed_scale), expected)


def test_even_element_is_the_low_nibble():
    packed = torch.tensor([[0x72, 0x00] * 8], dtype=torch.uint8)  # low nibble 2 (1.0), high 7 (6.0)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    w = dequantize_mxfp4(packed, scale)
    assert w[0, :4].tolist() == [2.0, 12.0, 0.0, 0.0]


def test_transformers_gpt_oss_layout():
    E, out, inp = 3, 8, 128
    stacked = [_random_mxfp4(out, inp, seed=2 + e, lo=100, hi=150) for e in range(E)]
    packed = torch.stack([p for p, _ in stacked])  # [E, out, in/2]
    scale = torch.stack([s for _, s in stacked])  # [E, out, in/32]
    # GPT-OSS: blocks [E, rows, G, 16], scales [E, rows, G]; output [E, in, rows]
    theirs = _convert_moe_packed_tensors(packed.view(E, out, inp // GROUP, 16), scale, dtype=torch.float32)
    assert torch.equal(dequantize_mxfp4(packed, scale).transpose(1, 2), theirs)


# quantisation --------------------------------------------------------------------------------
def test_our_quantize_read_by_their_unpack():
    w = torch.randn(64, 96, generator=_gen(3)) * 0.02
    packed, scale = quantize_mxfp4(w)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (64, 48) and scale.shape == (64, 3)
    assert torch.equal(_their_dequant(packed, scale), dequantize_mxfp4(packed, scale))


def test_round_trip_of_representable_values():
    w, expected_scale = _exact_e2m1_weight(32, 128, seed=4)
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(dequantize_mxfp4(packed, scale), w)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16), w.to(torch.bfloat16))
    zeros_packed, zeros_scale = quantize_mxfp4(torch.zeros(4, 64))
    assert torch.equal(dequantize_mxfp4(zeros_packed, zeros_scale), torch.zeros(4, 64))


def _ties_block() -> torch.Tensor:
    """One block with amax 4 (scale 2^0) holding every E2M1 midpoint and its fp32 neighbours."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up, down = torch.nextafter(mids, torch.tensor(10.0)), torch.nextafter(mids, torch.tensor(0.0))
    vals = torch.cat([mids, up, down, -mids[:4], torch.tensor([4.0])])
    return torch.cat([vals, torch.zeros(GROUP - vals.numel())])


def test_quantize_matches_compressed_tensors_compressor():
    """Where OCP's scale rule and compressed-tensors' agree (block |max| mantissa below 1.75;
    compressed-tensors rounds |max| to the nearest power of two first), the quantised weights are
    identical, including the ties-to-even rounding of E2M1 midpoints."""
    g = _gen(5)
    out, inp = 48, 128
    w = torch.randn(out, inp, generator=g)
    blocks = w.view(out, inp // GROUP, GROUP)
    amax = blocks.abs().amax(-1, keepdim=True)
    mantissa = 1.0 + 0.7 * torch.rand(amax.shape, generator=g)  # in [1, 1.7]
    target = mantissa * torch.exp2(torch.randint(-8, 8, amax.shape, generator=g).float())
    blocks.mul_(target / amax)
    w[0] = _ties_block().repeat(inp // GROUP)
    qscale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), K3_ARGS)
    theirs = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": qscale, "weight_zero_point": zero}, K3_SCHEME)
    packed, scale = quantize_mxfp4(w)
    assert torch.equal(scale, theirs["weight_scale"])
    # compare values: compressed-tensors encodes small negatives as -0 (code 8), we as +0 (code 0)
    assert torch.equal(dequantize_mxfp4(packed, scale), dequantize_mxfp4(theirs["weight_packed"], theirs["weight_scale"]))


def test_ties_round_to_even_code():
    packed, scale = quantize_mxfp4(_ties_block()[None])
    got = dequantize_mxfp4(packed, scale)[0, :26].tolist()
    assert got[:7] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # exact midpoints
    assert got[7:14] == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # just above
    assert got[14:21] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]  # just below
    assert got[21:26] == [0.0, -1.0, -1.0, -2.0, 4.0]


def test_block_max_above_six_saturates():
    w = torch.zeros(1, GROUP)
    w[0, :3] = torch.tensor([7.0, -7.5, 2.0])  # amax 7.5: OCP scale 2^(2 - 2) = 1
    packed, scale = quantize_mxfp4(w)
    assert scale.item() == 127
    assert dequantize_mxfp4(packed, scale)[0, :3].tolist() == [6.0, -6.0, 2.0]


def test_quantize_rejects_non_multiple_of_group():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
