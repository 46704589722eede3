"""`k3ray serve`: flags -> app args -> Serve deployment options, the Serve config YAML in cluster/,
and the command end to end (starts Ray + Serve on loopback, serves, stops everything on Ctrl-C)."""

import argparse
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import yaml

ray = pytest.importorskip("ray")

from k3ray.actors.pipeline_replica import actor_bundles  # noqa: E402
from k3ray.actors.serve_app import deployment_options  # noqa: E402
from k3ray.actors.serve_config import ServeArgs  # noqa: E402
from k3ray.actors.serve_engine import engine_config  # noqa: E402
from k3ray.actors import serve_cli as serve_cmd  # noqa: E402
from k3ray.actors.serve_flags import launch_settings  # noqa: E402
from k3ray.config import ModelConfig  # noqa: E402

pytestmark = pytest.mark.timeout(600)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return parser.parse_args(argv)


def test_no_flags_serve_the_default_model_on_loopback(monkeypatch):
    monkeypatch.delenv("K3RAY_API_KEY", raising=False)
    args = parse([])
    launch = launch_settings(args)
    assert (launch.host, launch.port, launch.address) == ("127.0.0.1", 8000, None)
    assert serve_cmd.app_args(args) == {}
    assert ServeArgs.model_validate({}) == ServeArgs()
    monkeypatch.setenv("K3RAY_API_KEY", "from-env")
    assert serve_cmd.app_args(args) == {"server": {"api_key": "from-env"}}


def test_flags_become_deployment_options(tiny_checkpoint):
    args = parse(["--model", tiny_checkpoint, "--pipeline", "2", "--expert-parallel", "2", "--min-replicas", "1",
                  "--max-replicas", "3", "--target-ongoing-requests", "4", "--upscale-delay-s", "1",
                  "--downscale-delay-s", "5", "--max-queued-requests", "10", "--retry-after-s", "3",
                  "--no-enable-prefix-caching", "--speculative-ngram", "3", "--max-num-seqs", "8",
                  "--served-model-name", "k3", "--stage-cpus", "2"])
    resolved = ServeArgs.model_validate(serve_cmd.app_args(args)).resolved()
    assert resolved.server.served_model_name == "k3" and resolved.model.model == os.path.abspath(tiny_checkpoint)
    opts = deployment_options(resolved)
    assert opts["autoscaling_config"] | {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4.0,
                                         "upscale_delay_s": 1.0, "downscale_delay_s": 5.0} == opts["autoscaling_config"]
    assert opts["max_queued_requests"] == 10 and opts["max_ongoing_requests"] == 8
    assert (opts["backpressure_config"].status_code, opts["backpressure_config"].retry_after_s) == (429, 3.0)
    bundles, _ = actor_bundles(ModelConfig.from_json_file(f"{tiny_checkpoint}/config.json"), resolved.parallel_config())
    assert opts["placement_group_bundles"] == [{"CPU": 1.0}] + bundles and {"CPU": 2.0} in bundles
    engine = engine_config(resolved)
    assert not engine.enable_prefix_caching and engine.speculative.num_speculative_tokens == 3
    local = ServeArgs.model_validate({"model": {"model": tiny_checkpoint}}).resolved()
    assert "placement_group_bundles" not in deployment_options(local)


def test_bad_flags_fail_before_starting_anything():
    with pytest.raises(ValueError, match="ingress applies to the local Ray"):
        serve_cmd.main(parse(["--address", "127.0.0.1:1", "--ingress", "proxy"]))
    with pytest.raises(ValueError, match="min_replicas"):
        serve_cmd.main(parse(["--min-replicas", "3", "--max-replicas", "1"]))
    with pytest.raises(ValueError, match="pipeline"):
        serve_cmd.main(parse(["--pipeline", "0"]))


def test_command_module_does_not_import_ray(tmp_path):
    code = "import sys, k3ray.actors.serve_cli; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path)  # off the repository root


def test_serve_config_yaml_deploys_the_same_app(tiny_checkpoint):
    from ray.serve.schema import ServeDeploySchema

    from k3ray.actors.serve_app import build_app

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "cluster" / "serve-config.yaml").read_text()))
    assert config.http_options.host == "127.0.0.1"
    (app,) = config.applications
    assert app.import_path == "k3ray.actors.serve_app:build_app"
    args = ServeArgs.model_validate(app.args)
    assert (args.autoscaling.min_replicas, args.autoscaling.max_replicas) == (1, 2)
    assert args.server.max_queued_requests == 256
    deployment = build_app({**app.args, "model": {**app.args["model"], "model": tiny_checkpoint}})._bound_deployment
    assert deployment.name == "K3Server"
    assert deployment._deployment_config.autoscaling_config.max_replicas == 2
    assert deployment._deployment_config.max_queued_requests == 256


@contextlib.contextmanager
def serve_command(checkpoint: str, tmp_path, *flags: str):
    """`k3ray serve` as a child process on a free loopback port: yields (process, url, log path,
    Ray's processes under it, filled in by the test); whatever still runs afterwards is killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "k3ray.actors.serve_cli", "--model", checkpoint, "--port", str(port),
           "--max-model-len", "128", "--cache-memory-mb", "16", "--num-cpus", "4", *flags]
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    tree: list[psutil.Process] = []
    try:
        yield proc, f"http://127.0.0.1:{port}", log_path, tree
    finally:
        for p in [psutil.Process(proc.pid), *tree] if proc.poll() is None else tree:
            if p.is_running():
                p.kill()
        proc.wait(timeout=60)
        log.close()


def ctrl_c_stops_everything(proc, log_path, tree: list[psutil.Process]) -> None:
    tree[:] = psutil.Process(proc.pid).children(recursive=True)
    assert tree, "Ray's processes should be children of the command"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    assert "graceful_shutdown failed" not in log_path.read_text()  # a clean stop logs no killed task
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, [p.info for p in alive if p.is_running()]


def haproxy_listeners(root: psutil.Process) -> list[str]:
    """host:port of every listening socket of the HAProxy processes under `root`."""
    found = [p for p in root.children(recursive=True) if p.name() == "haproxy"]
    assert found, "no HAProxy process under k3ray serve"
    return [f"{c.laddr.ip}:{c.laddr.port}" for p in found for c in p.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN]


@pytest.mark.parametrize("ingress", ["haproxy", "proxy"])
def test_k3ray_serve_runs_until_ctrl_c_and_leaves_nothing(tiny_checkpoint, tmp_path, ingress):
    with serve_command(tiny_checkpoint, tmp_path, "--ingress", ingress) as (proc, url, log_path, tree):
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "k3ray serve did not come up"
            time.sleep(1)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        if ingress == "haproxy":  # the API port and HAProxy's stats / Prometheus ports, all on loopback
            listeners = haproxy_listeners(psutil.Process(proc.pid))
            assert url.removeprefix("http://") in listeners and len(listeners) >= 3, listeners
            assert all(address.startswith("127.0.0.1:") for address in listeners), listeners
        ctrl_c_stops_everything(proc, log_path, tree)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/v1/models", timeout=5)


def test_ctrl_c_while_deploying_still_stops_everything(tiny_checkpoint, tmp_path):
    """A Ctrl-C that lands inside Serve's deploy (Ray's own waits) is not lost."""
    with serve_command(tiny_checkpoint, tmp_path) as (proc, _, log_path, tree):
        deadline = time.monotonic() + 300
        while "Started Serve" not in log_path.read_text():  # Ray is up, the app is being deployed
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        ctrl_c_stops_everything(proc, log_path, tree)
