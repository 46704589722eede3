"""ray.init from a neutral working directory.

Ray puts the driver's working directory at the front of every worker's sys.path, and the processes
of a node it starts keep the directory they started in. Started from a k3ray checkout, that
directory holds the source k3ray/ without k3ray.kernels, .actors and .evals (they install from the
folders beside it), so a worker, or a `python -m` it runs, would import that half package instead
of the installed one. Connecting (and starting nodes) from elsewhere keeps the repository root off
their sys.path."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import ray


@contextlib.contextmanager
def neutral_cwd() -> Iterator[str]:
    """The current directory away from any checkout (the temp folder) for the block's duration."""
    here = os.getcwd()
    os.chdir(tempfile.gettempdir())
    try:
        yield os.getcwd()
    finally:
        os.chdir(here)


def connect(**init_kwargs) -> "ray._private.worker.BaseContext":
    """ray.init(**init_kwargs) from a neutral working directory."""
    with neutral_cwd():
        return ray.init(**init_kwargs)
