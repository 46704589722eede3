#!/usr/bin/env bash
# The prepared GPU check, for an offline GPU host whose torch and triton are preinstalled (no
# package index): installs the wheels of tests/gpu/build_wheels.sh, runs `pytest -m gpu` with k3ray
# from the wheel, then the GPU benchmarks, each step under its own timeout and the whole under
# 8 minutes; every result is written into the output folder as soon as its step ends.
#
#   tests/gpu/run.sh [WHEEL_DIR]     (default: .whl at the repository root)
#   output: $OUT if set, else ./gpu-results: env.txt, status.txt (step, exit code, seconds),
#           <step>.log, pytest.xml, bench_{layer,engine,kernels}.json
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
wheels=$(cd "${1:-$root/.whl}" && pwd) || { echo "no wheel folder: build it with tests/gpu/build_wheels.sh" >&2; exit 2; }
out=${OUT:-$PWD/gpu-results}
py=${PYTHON:-python3}
budget_s=${GPU_CHECK_BUDGET_S:-450}  # all steps together, under the 8 minutes
mkdir -p "$out" && out=$(cd "$out" && pwd)
start=$(date +%s)

# step NAME LIMIT_S CMD...: CMD under timeout (LIMIT_S, or what is left of the budget), its output
# in NAME.log, one line in status.txt
step() {
  local name=$1 limit=$2 left t0 rc
  shift 2
  left=$((budget_s - ($(date +%s) - start)))
  ((limit > left)) && limit=$left
  if ((limit < 10)); then
    echo "$name skipped 0 (out of time)" >>"$out/status.txt"
    return
  fi
  echo "[$(date +%T)] $name (timeout ${limit}s)"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "$name $rc $(($(date +%s) - t0))" >>"$out/status.txt"
  echo "[$(date +%T)] $name exit $rc"
}

site=$(mktemp -d /tmp/k3ray-site.XXXX)
work=$(mktemp -d /tmp/k3ray-gpu.XXXX)  # only tests/, training/ and pyproject.toml: k3ray comes from the wheel
cp -r "$root/tests" "$root/training" "$root/pyproject.toml" "$work/"
export PYTHONPATH=$site K3RAY_TEST_GPU=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$work"

step install 60 "$py" -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c 'import sys, torch, triton, k3ray; print(sys.version); print("k3ray from", k3ray.__file__); print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
} >"$out/env.txt" 2>&1
k3ray=("$py" -m k3ray.cli)
step pytest_gpu 200 "$py" -m pytest -m gpu tests/kernels tests/k3ray tests/gpu tests/training -q -p no:cacheprovider \
  --continue-on-collection-errors --junitxml "$out/pytest.xml"
step bench_layer 110 "${k3ray[@]}" bench layer --model k3 --device cuda --json "$out/bench_layer.json"
step bench_engine 70 "${k3ray[@]}" bench engine --device cuda --skip long --json "$out/bench_engine.json"
compare=()
"${k3ray[@]}" bench kernels --help 2>/dev/null | grep -q -- "--compare " && compare=(--compare)
step bench_kernels 90 "${k3ray[@]}" bench kernels --device cuda "${compare[@]}" --json "$out/bench_kernels.json"
echo "done in $(($(date +%s) - start))s; results in $out"
cat "$out/status.txt"
rm -rf "$site" "$work"
! grep -qv " 0 [0-9]*$" "$out/status.txt"  # exit 1 when a step failed or was skipped
