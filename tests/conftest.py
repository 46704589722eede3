"""Test-wide settings: offline hubs, Triton's CPU interpreter, loopback-only Ray, the gpu marker."""

import os

# before anything imports triton or a hub client
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if not os.environ.get("K3RAY_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny shapes: threads cost more than they give, and 2 cores are shared


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip without CUDA; `slow` tests (1M-token runs) run only when `-m` names them."""
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_slow = pytest.mark.skip(reason="slow: select with -m slow")
    run_slow = "slow" in (config.getoption("-m") or "")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)



@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled tensors, so an unwritten output element fails."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan_fill(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan_fill(empty_like(*a, **kw)))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The default tiny K3 checkpoint (bf16 + MXFP4 experts + byte tokenizer) in a temp dir."""
    from k3ray.default_model import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("k3-tiny")))


@pytest.fixture(scope="session")
def k2_tiny_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny K3 with Kimi K2's tokenizer and chat format (the shipped fixtures' format)."""
    import shutil

    from k3ray.tokenizer import ByteTokenizer

    path = tmp_path_factory.mktemp("k3-tiny-k2") / "checkpoint"
    shutil.copytree(tiny_checkpoint, path)
    ByteTokenizer(vocab_size=512).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real multi-node Ray cluster on loopback: a head and two workers with custom resources
    (`stage_node` on worker 1, `shard_node` on worker 2) so tests can place actors per node.
    Stopped (every process) at the end of the session."""
    import ray
    from ray.cluster_utils import Cluster

    from k3ray.actors.cluster.ray_connect import connect, neutral_cwd  # off the repository root

    with neutral_cwd():  # the nodes' processes keep the directory they start in
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        workers = [
            cluster.add_node(num_cpus=8, resources={"stage_node": 100}),
            cluster.add_node(num_cpus=16, resources={"shard_node": 100}),
        ]
        cluster.wait_for_nodes()
    connect(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster, workers
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def echo_checkpoint(tmp_path_factory):
    """A tiny K3 checkpoint whose greedy output falls into repeating its last token (lm_head tied
    to the embedding, layer outputs damped): speculative drafts then get accepted, which a random
    model almost never does. Still a full K3 forward (every layer, routing and expert runs)."""
    from k3ray.config import k3_tiny_config
    from k3ray.models.init import build_model
    from k3ray.tokenizer import ByteTokenizer
    from k3ray.weights import save_checkpoint

    model = build_model(k3_tiny_config(), torch.bfloat16, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")):
                p.mul_(0.5)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * 0.3)
    path = str(tmp_path_factory.mktemp("k3-tiny-echo"))
    save_checkpoint(model, path)
    ByteTokenizer(vocab_size=512).save_pretrained(path)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeRay:
    """The Ray instance the modules' Serve apps run on: started, as `k3ray serve` starts its own
    (loopback, the haproxy ingress, its own ports and HAProxy files), by the first module that
    deploys, and stopped after the last one (an idle Ray costs the other tests CPU). Its processes
    are their own, so the driver can leave it for ray_cluster and rejoin."""

    def __init__(self):
        self.head = None
        self.environment: dict[str, str] = {}

    def address(self) -> str:
        if self.head is None:
            from ray.cluster_utils import Cluster

            from k3ray.actors.cluster.ray_connect import neutral_cwd
            from k3ray.actors.serve import launch as serve_launch

            self.environment = serve_launch.local_environment("haproxy")
            with pytest.MonkeyPatch.context() as patch, neutral_cwd():
                for name, value in self.environment.items():
                    patch.setenv(name, value)
                self.head = Cluster(initialize_head=True, head_node_args={
                    "num_cpus": 8, "include_dashboard": False, "node_ip_address": serve_launch.LOOPBACK,
                    "object_store_memory": 512 << 20})
        return self.head.address

    def stop(self) -> None:
        from k3ray.actors.serve.isolation import remove_runtime_dir

        if self.head is not None:
            self.head.shutdown()
            remove_runtime_dir(self.environment["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
            self.head = None


@pytest.fixture(scope="session")
def serve_ray():
    ray_for_serve = ServeRay()
    try:
        yield ray_for_serve
    finally:
        ray_for_serve.stop()


def later_modules_use(request, fixture: str) -> bool:
    """Whether a test of a module after request's (in this run's order) uses `fixture`."""
    items = request.session.items
    last = max(i for i, item in enumerate(items) if item.module is request.module)
    return any(fixture in item.fixturenames for item in items[last + 1:])


@pytest.fixture(scope="module")
def serve_app(serve_ray, request):
    """Deploy k3ray's Serve app on 127.0.0.1: `serve_app(args, **deploy_options) -> base URL` (a free
    port unless given), on the Serve Ray (serve_ray) with this process's environment as `k3ray serve`
    has it; Serve is shut down after the module (its apps, replicas, placement groups and HAProxy),
    so the next module's starts clean. A session-wide test cluster (ray_cluster) the process is
    connected to is left for the module and rejoined after."""
    import ray

    from k3ray.actors.cluster.ray_connect import connect
    from k3ray.actors.serve import launch as serve_launch

    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if previous is not None:
        ray.shutdown()
    address = serve_ray.address()

    def deploy(args: dict, **options) -> str:
        options.setdefault("port", free_port())
        options.setdefault("proxy_location", "HeadOnly")
        return serve_launch.deploy(args, **options)

    with pytest.MonkeyPatch.context() as patch:
        for name, value in serve_ray.environment.items():
            patch.setenv(name, value)
        for module in (serve_launch.serve_constants, serve_launch.serve_build_app):
            patch.setattr(module, "RAY_SERVE_ENABLE_HA_PROXY", True)
        connect(address=address, log_to_driver=False)
        try:
            yield deploy
        finally:
            serve_launch.shutdown_serve()
            ray.shutdown()
    if not later_modules_use(request, "serve_app"):
        serve_ray.stop()
    if previous is not None:
        connect(address=previous, log_to_driver=False)


@pytest.fixture
def k3server_replicas():
    """`k3server_replicas()` -> the K3Server replica processes of the Ray this process is connected
    to: a replica's parent is its node's raylet, started with that Ray's GCS address (another server
    on the machine, a second test run's, has replicas of its own)."""
    import psutil
    import ray

    gcs_flag = f"--gcs-address={ray.get_runtime_context().gcs_address}"

    def replicas() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if "ServeReplica:k3ray:K3Server" in " ".join(proc.info["cmdline"] or []):
                raylet = proc.parent()
                if raylet is not None and gcs_flag in raylet.cmdline():
                    found.append(proc)
        return found

    return replicas


@pytest.fixture
def wait_until_serving():
    """`wait_until_serving(process, url, log_path, timeout_s=300)`: until `url`/v1/models answers 200,
    failing with the log's tail if the server process exits first or time runs out."""
    import time

    import httpx

    def wait(process, url: str, log_path, timeout_s: float = 300, headers: dict | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/v1/models", headers=headers, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server at {url} did not come up"
            time.sleep(1)

    return wait


SERVE_PROBE = """
import sys
from k3ray.cli import main
try:
    code = main(["serve", *sys.argv[1:]])
finally:
    print("ray imported:", "ray" in sys.modules)
sys.exit(code)
"""


@pytest.fixture
def serve_error_line():
    """`serve_error_line(flags, cwd) -> (line, stdout)`: `k3ray serve FLAGS` run in `cwd` must exit 2
    with one stderr line, `k3ray serve: error: ...`, without importing Ray (found before anything
    starts); that line, and its stdout."""
    import subprocess
    import sys

    def run(flags: list[str], cwd) -> tuple[str, str]:
        out = subprocess.run([sys.executable, "-c", SERVE_PROBE, *flags], capture_output=True, text=True, timeout=120,
                             cwd=cwd)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
        assert lines[0].startswith("k3ray serve: error: "), lines[0]
        *stdout, ray_imported = out.stdout.splitlines()
        assert ray_imported == "ray imported: False", "Ray was imported before the error"
        return lines[0], "\n".join(stdout)

    return run
