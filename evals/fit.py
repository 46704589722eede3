"""Token-exact prompts: search the haystack size whose rendered prompt has exactly N tokens.

`render(n)` builds the whole prompt around the first `n` characters of a haystack; its token
count grows with `n` almost linearly (about one token per few characters) and by at most a token
or two per character. A secant step from the empty haystack lands within a few tokens of the
target after two or three counts, then interpolation inside the bracket (falling back to
bisection) finishes. Every count is one tokenize call, so remote targets make few round trips.
"""

from __future__ import annotations

from collections.abc import Callable

# how far past a bracket whose two ends jump over the target we look for a landing point
_NEIGHBOURHOOD = 16


def fit_to_length(
    render: Callable[[int], str],
    count: Callable[[str], int],
    length: int,
    *,
    chars_per_token: float = 4.0,
    max_calls: int = 64,
) -> tuple[str, int]:
    """Return `(prompt, n)` with `count(prompt) == length` and `prompt == render(n)`."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    counts: dict[int, int] = {}

    def measure(n: int) -> int:
        if n not in counts:
            if len(counts) >= max_calls:
                raise ValueError(f"no prompt of exactly {length} tokens found in {max_calls} tokenize calls")
            counts[n] = count(render(n))
        return counts[n]

    base = measure(0)
    if base > length:
        raise ValueError(f"length {length} is below the {base} tokens this task's prompt needs without any haystack")
    lo, hi = 0, None
    n = max(1, round((length - base) * chars_per_token))
    while measure(n) != length:
        if measure(n) < length:
            lo = max(lo, n)
        else:
            hi = n if hi is None else min(hi, n)
        if hi is None:
            # extrapolate with the chars-per-token slope seen so far
            slope = lo / max(measure(lo) - base, 1)
            n = lo + max(1, round((length - measure(lo)) * slope))
        elif hi - lo <= 1:
            return _land_near(render, measure, length, lo, hi)
        else:
            n = _next_inside(lo, hi, measure(lo), measure(hi), length, bisect=len(counts) > 12)
    return render(n), n


def _next_inside(lo: int, hi: int, c_lo: int, c_hi: int, length: int, *, bisect: bool) -> int:
    if bisect or c_hi == c_lo:
        return (lo + hi) // 2
    n = lo + round((length - c_lo) * (hi - lo) / (c_hi - c_lo))
    return min(max(n, lo + 1), hi - 1)


def _land_near(render, measure, length: int, lo: int, hi: int) -> tuple[str, int]:
    # one character crossed the target by two tokens; a few more characters usually re-merge
    for n in range(hi + 1, hi + _NEIGHBOURHOOD):
        if measure(n) == length:
            return render(n), n
    raise ValueError(
        f"no prompt of exactly {length} tokens: a haystack of {lo} characters gives {measure(lo)} tokens "
        f"and one of {hi} gives {measure(hi)}"
    )
