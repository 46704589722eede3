"""Comparison helpers shared by the test suite and benchmarks (fla's criterion)."""

from __future__ import annotations

import torch


def rel_rmse(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Relative RMS error ||out - ref|| / ||ref||; fails on NaN in the output."""
    ref, out = ref.double(), out.double()
    assert not torch.isnan(out).any(), "output has NaNs"
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float) -> None:
    err = rel_rmse(ref, out)
    assert err <= ratio, f"{name}: relative RMSE {err:.3e} > {ratio:.1e}"
