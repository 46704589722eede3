"""Fixtures of the kernel tests."""

import os
import subprocess
import sys

import pytest


@pytest.fixture
def compile_for_sm90(tmp_path):
    """Runs a test file's compile_kernels_for_sm90() in a fresh Python without TRITON_INTERPRET (the
    interpreter patches triton.language and breaks real compiles), off the repository root."""

    def run(test_file: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = (f"import importlib.util as u; s = u.spec_from_file_location('t', {test_file!r}); "
                "m = u.module_from_spec(s); s.loader.exec_module(m); m.compile_kernels_for_sm90()")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]

    return run
