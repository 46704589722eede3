"""Launch helpers shared by the MLA Triton kernels."""

from __future__ import annotations

import triton

MIN_DOT = 16  # tl.dot needs every dimension >= 16


def pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))
