"""MXFP4 (OCP MX, E2M1 elements + E8M0 block scales) in compressed-tensors' packed layout.

weight_packed [out, in/2] uint8: element 2j in the LOW nibble, 2j+1 in the high nibble;
weight_scale [out, in/32] uint8: value 2^(s - 127) for the 32 elements of block in//32.
"""

from __future__ import annotations

import functools

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])  # codes 8..15 carry the sign bit


@functools.lru_cache(maxsize=16)
def _byte_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[256, 2]: the (low, high) nibble values of every byte."""
    codes = torch.arange(256, device=device)
    return _e2m1_table(device)[torch.stack([codes & 0x0F, codes >> 4], -1)].to(dtype)


def _unpack(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    pairs = _byte_table(packed.device, dtype).index_select(0, packed.reshape(-1).int())  # [numel, 2]
    return pairs.view(*packed.shape[:-1], packed.shape[-1] * 2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] uint8 -> [..., n] fp32 E2M1 values (one table lookup per byte)."""
    return _unpack(packed, torch.float32)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in/2] packed + [out, in/32] E8M0 -> [out, in] in dtype (exact in fp32 and bf16)."""
    work = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # E2M1 * 2^k is exact in bf16 too
    vals = _unpack(packed, work)  # [out, in]
    s = torch.exp2(scale.float() - 127.0).to(work)  # [out, in/32]
    out = vals.view(*vals.shape[:-1], -1, GROUP) * s[..., None]
    return out.reshape(vals.shape).to(dtype)


def _round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to the even code), sign in bit 3; magnitudes above 6 saturate."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.long, device=x.device)
    for i, mid in enumerate(E2M1_MIDPOINTS):
        # midpoint i sits between codes i and i + 1: a tie goes up only when i + 1 is even
        code += (mag >= mid) if i % 2 else (mag > mid)
    sign = ((x < 0) & (code > 0)).long() << 3
    return code | sign


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (packed [out, in/2] uint8, scale [out, in/32] uint8).

    OCP scale choice: 2^(floor(log2(amax)) - 2) so the block max lands in [4, 8) before rounding
    (values above 6 saturate)."""
    out_dim, in_dim = w.shape
    if in_dim % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}, got {in_dim}")
    blocks = w.float().view(out_dim, in_dim // GROUP, GROUP)
    amax = blocks.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    codes = _round_to_e2m1_codes(blocks / torch.exp2(exp)[..., None]).view(out_dim, in_dim)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)
