"""A driver started in the repository root still gives its Ray workers the installed k3ray: Ray puts
the driver's working directory first on every worker's sys.path, where the source k3ray/ (without
k3ray.kernels, .actors, .evals beside it) would shadow the installed package."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
import ray
import k3ray
import k3ray.kernels.kda.naive as naive
from k3ray.actors.cluster.ray_connect import connect

os.chdir(sys.argv[1])  # after the imports: python -c resolves its "" path entry against the cwd

connect(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
try:
    @ray.remote(num_cpus=0)
    def worker_files():
        import sys
        import k3ray
        import k3ray.kernels.kda.naive as naive
        return k3ray.__file__, naive.__file__, sys.path

    k3ray_file, naive_file, path = ray.get(worker_files.remote(), timeout=120)
    assert os.getcwd() == sys.argv[1]
    assert (k3ray_file, naive_file) == (k3ray.__file__, naive.__file__), (k3ray_file, naive_file, path[:4])
    assert sys.argv[1] not in path, path[:4]
    print("same files")
finally:
    ray.shutdown()
"""


def test_workers_of_a_driver_in_the_checkout_import_the_drivers_k3ray(tmp_path):
    # the interpreter starts outside the checkout (python -c puts its cwd first on sys.path); the
    # script then moves into the checkout, as a user running `k3ray serve` there would be
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same files" in done.stdout
