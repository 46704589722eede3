"""`--threads`: torch's CPU threads per process, with a default that is fast on small machines.

Torch-free until a command applies it, so building a parser stays fast. On a machine with at most
SMALL_MACHINE_CORES cores one thread per process wins (`k3ray generate` on 2 busy cores: 32 tok/s
at 1 thread, 0.9 tok/s at torch's default of 2); larger machines keep torch's default.
"""

from __future__ import annotations

import argparse
import os

SMALL_MACHINE_CORES = 4


def default_threads() -> int | None:
    """1 on a machine with <= SMALL_MACHINE_CORES cores, else None (torch's default)."""
    return 1 if (os.cpu_count() or 1) <= SMALL_MACHINE_CORES else None


def add_threads_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                         whose: str = "this process") -> None:
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help=f"torch CPU threads of {whose} (default: 1 on a machine with <= {SMALL_MACHINE_CORES} "
                        "cores, else torch's)")


def resolved_threads(threads: int | None) -> int | None:
    """The thread count to set: the one given (>= 1), else the default (None: leave torch's)."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be an int >= 1, got {threads!r}")
    return threads if threads is not None else default_threads()


def set_threads(threads: int | None) -> None:
    """Apply `--threads` (or its default) to torch in this process."""
    count = resolved_threads(threads)
    if count is not None:
        import torch  # lazy: torch-free until a command applies it (parsers import this module)

        torch.set_num_threads(count)
