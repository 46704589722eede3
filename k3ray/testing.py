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


def finish_request(engine, request_id: str):
    """Step `engine` (an LLMEngine) until it has nothing left; the final output of `request_id`, or the
    error that failed it (take_failed) raised."""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    failed = dict(engine.take_failed())
    if request_id in failed:
        raise failed[request_id]
    return final
