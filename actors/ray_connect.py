"""ray.init from a neutral working directory.

Ray puts the driver's working directory at the front of every worker's sys.path. Started from a
k3ray checkout, that directory holds the source k3ray/ without k3ray.kernels, .actors and .evals
(they install from the folders beside it), so a worker would import that half package instead of
the installed one. Connecting from elsewhere keeps the repository root off the workers' sys.path."""

from __future__ import annotations

import os
import tempfile

import ray


def connect(**init_kwargs) -> "ray._private.worker.BaseContext":
    """ray.init(**init_kwargs), with the current directory away from any checkout while it connects."""
    here = os.getcwd()
    os.chdir(tempfile.gettempdir())
    try:
        return ray.init(**init_kwargs)
    finally:
        os.chdir(here)
