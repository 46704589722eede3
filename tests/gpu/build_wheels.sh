#!/usr/bin/env bash
# Build, on a machine with a package index, what tests/gpu/run.sh installs on an offline GPU host
# (torch and triton preinstalled there, Python 3.12, no index): k3ray's wheel, fla-core 0.6.0
# (pure Python: the side-by-side baseline of `bench kernels --compare`), and binary wheels for the
# host's Python of what k3ray imports beyond the host's own packages (tiktoken, pillow, psutil).
#
#   tests/gpu/build_wheels.sh [OUT_DIR]     (default: .whl at the repository root; carry it over)
#   GPU_PYTHON=3.12 GPU_PLATFORM=manylinux_2_28_x86_64 set the host's Python and platform
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$root/.whl}
pip=(${PIP:-python3 -m pip})
py=${GPU_PYTHON:-3.12}
platform=${GPU_PLATFORM:-manylinux_2_28_x86_64}
rm -rf "$out" && mkdir -p "$out"
"${pip[@]}" wheel -q --no-deps --no-build-isolation "$root" -w "$out"
"${pip[@]}" download -q --no-deps --only-binary=:all: -d "$out" fla-core==0.6.0
# binary wheels for the host: its Python and platform (manylinux_2_28 also takes 2_17 wheels)
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform "$platform" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$out" tiktoken pillow psutil
ls -l "$out"
