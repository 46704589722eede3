"""MXFP4 (OCP MX, E2M1 elements + E8M0 block scales) in compressed-tensors' packed layout.

weight_packed [out, in/2] uint8: element 2j in the LOW nibble, 2j+1 in the high nibble;
weight_scale [out, in/32] uint8: value 2^(s - 127) for the 32 elements of block in//32.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])  # codes 8..15 carry the sign bit


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] uint8 -> [..., n] fp32 E2M1 values."""
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], -1).flatten(-2)
    return _e2m1_table(packed.device)[codes]


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in/2] packed + [out, in/32] E8M0 -> [out, in] in dtype (exact in fp32 and bf16)."""
    vals = unpack_fp4(packed)  # [out, in]
    s = torch.exp2(scale.float() - 127.0)  # [out, in/32]
    out = vals.view(*vals.shape[:-1], -1, GROUP) * s[..., None]
    return out.reshape(vals.shape).to(dtype)


def _round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (ties to even mantissa) for |x| <= 6, sign in bit 3."""
    mag = x.abs().clamp(max=6.0)
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    dist = (mag[..., None] - pos).abs()
    # prefer the even code on ties: add a tiny penalty to odd codes
    dist = dist + (torch.arange(8, device=x.device) % 2) * 1e-7
    code = dist.argmin(-1)
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
