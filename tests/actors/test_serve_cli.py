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
import types

import httpx
import psutil
import pytest
import yaml

from k3ray.actors.pipeline.executor import actor_bundles
from k3ray.actors.serve import cli as serve_cmd
from k3ray.actors.serve.app import deployment_options
from k3ray.actors.serve.config import ServeArgs
from k3ray.actors.serve.engine import engine_config
from k3ray.actors.serve.flags import launch_settings
from k3ray.config import ModelConfig

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
    assert (launch.host, launch.port, launch.address) == (None, 8000, None)  # the host: where the nodes are
    assert launch.on_nodes(["127.0.0.1"]).host == "127.0.0.1"  # the local instance's one node: loopback
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


def checkpoint_without_tokenizer(checkpoint: str, into: pathlib.Path) -> str:
    into.mkdir()
    for f in pathlib.Path(checkpoint).iterdir():
        if f.name == "config.json" or ".safetensors" in f.name:
            (into / f.name).symlink_to(f)
    return str(into)


@pytest.mark.parametrize("case", ["no checkpoint", "no tokenizer", "layout too large"])
def test_bad_checkpoint_or_layout_fails_in_one_line_before_ray(tiny_checkpoint, tmp_path, case, serve_error_line):
    """Found before Ray is imported (serve_error_line checks it): the command exits with one `k3ray serve:
    error:` line (it used to start Serve and crash minutes later, or wait forever for resources)."""
    flags, words = {
        "no checkpoint": (["--model", "/does/not/exist"], "is not a directory"),
        "no tokenizer": (["--model", checkpoint_without_tokenizer(tiny_checkpoint, tmp_path / "ckpt")], "no tokenizer"),
        "layout too large": (["--model", tiny_checkpoint, "--pipeline", "2", "--expert-parallel", "2",
                              "--num-cpus", "2"], "CPUs, but 2 are available"),
    }[case]
    line, stdout = serve_error_line(flags, tmp_path)
    assert words in line, line
    assert "ray" not in stdout.lower()  # nothing was started


def test_command_module_does_not_import_ray(tmp_path):
    code = "import sys, k3ray.actors.serve.cli; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=tmp_path)  # off the repository root


def test_serve_config_yaml_deploys_the_same_app(tiny_checkpoint):
    from ray.serve.schema import ServeDeploySchema

    from k3ray.actors.serve.app import build_app

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "cluster" / "serve-config.yaml").read_text()))
    assert config.http_options.host == "127.0.0.1"
    (app,) = config.applications
    assert app.import_path == "k3ray.actors.serve.app:build_app"
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
    cmd = [sys.executable, "-m", "k3ray.actors.serve.cli", "--model", checkpoint, "--port", str(port),
           "--max-model-len", "128", "--cache-memory-mb", "16", "--num-cpus", "4",
           "--stop-grace-s", "120", *flags]  # a loaded machine's slow graceful stop is no failure
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
    """Ctrl-C: the command exits 0, and nothing it started runs once it has exited: it stops what
    outlived Ray's shutdown before it exits (test_serve_stop.py has the other signals)."""
    tree[:] = psutil.Process(proc.pid).children(recursive=True)
    assert tree, "Ray's processes should be children of the command"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    assert "graceful_shutdown failed" not in log_path.read_text()  # a clean stop logs no killed task
    alive = [p for p in tree if _running(p)]
    assert not alive, [_described(p) for p in alive]


def test_leftover_processes_are_waited_for_then_terminated_then_killed():
    """What `k3ray serve` does with Ray's processes after Ray's shutdown: one that exits within the grace is
    left to exit; one still up gets SIGTERM; one that ignores SIGTERM gets SIGKILL."""
    from k3ray.actors.serve.reaper import stop_processes as reap_leftovers

    code = "import signal, sys, time; {}print('ready', flush=True); time.sleep({})"
    quick, polite, stubborn = (
        subprocess.Popen([sys.executable, "-c", code.format(ignore, sleep)], stdout=subprocess.PIPE)
        for ignore, sleep in (("", 0.5), ("", 60), ("signal.signal(signal.SIGTERM, signal.SIG_IGN); ", 60)))
    for child in (quick, polite, stubborn):
        assert child.stdout.readline() == b"ready\n"  # started, and its SIGTERM handler is set
    processes = [psutil.Process(child.pid) for child in (quick, polite, stubborn)]
    stopped = reap_leftovers(processes, grace_s=3.0)
    assert [p.pid for p in stopped] == [polite.pid, stubborn.pid]
    assert [p.returncode for p in processes] == [0, -signal.SIGTERM, -signal.SIGKILL]
    assert not any(p.is_running() for p in processes)


def _running(p: psutil.Process) -> bool:
    """Still running (a zombie has exited: only its parent has yet to reap it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _described(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"{p.pid} (gone)"


def haproxy_listeners(root: psutil.Process) -> list[str]:
    """host:port of every listening socket of the HAProxy processes under `root`."""
    found = [p for p in root.children(recursive=True) if p.name() == "haproxy"]
    assert found, "no HAProxy process under k3ray serve"
    return [f"{c.laddr.ip}:{c.laddr.port}" for p in found for c in p.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN]


def non_loopback_listeners(root: psutil.Process) -> list[str]:
    """`process name host:port` of every listening TCP socket under `root` that is not on loopback
    (an IPv4-mapped ::ffff:127.0.0.1 is loopback), and how many listeners there are in all."""
    found, count = [], 0
    for p in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for c in p.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN:
                    count += 1
                    if c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
                        found.append(f"{' '.join(p.cmdline())[:40]} {c.laddr.ip}:{c.laddr.port}")
    assert count, "no listener under the command"
    return found


class StartupWatch:
    """Polls /ready and /v1/models on a thread until stop(); `bad` holds every answer that is not a
    503 with Retry-After and an OpenAI error body (a 404 from an app that is not up yet, say)."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.bad, self.done = url, [], threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            for path in ("/ready", "/v1/models"):
                try:
                    r = httpx.get(f"{self.url}{path}", timeout=5)
                except httpx.HTTPError:
                    continue  # nothing listens yet
                if r.status_code == 200:
                    continue
                try:
                    has_error_body = "error" in r.json()
                except ValueError:
                    has_error_body = False
                if not (r.status_code == 503 and "retry-after" in r.headers and has_error_body):
                    self.bad.append((path, r.status_code, r.text[:200]))
            self.done.wait(0.2)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=30)


@pytest.mark.parametrize("ingress", ["haproxy", "proxy"])
def test_k3ray_serve_runs_until_ctrl_c_and_leaves_nothing(tiny_checkpoint, tmp_path, ingress, wait_until_serving):
    with serve_command(tiny_checkpoint, tmp_path, "--ingress", ingress) as (proc, url, log_path, tree):
        starting = StartupWatch(url)
        wait_until_serving(proc, url, log_path)
        starting.stop()
        if ingress == "haproxy":  # while it started: no answer, or a 503 that says retry; never a 404
            assert not starting.bad, starting.bad
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        if ingress == "haproxy":  # the API port and HAProxy's stats / Prometheus ports, all on loopback
            listeners = haproxy_listeners(psutil.Process(proc.pid))
            assert url.removeprefix("http://") in listeners and len(listeners) >= 3, listeners
            assert all(address.startswith("127.0.0.1:") for address in listeners), listeners
            (admin,) = pathlib.Path("/tmp").glob(f"k3serve-{proc.pid}-*/*/admin.sock")
            assert admin.stat().st_mode & 0o077 == 0, oct(admin.stat().st_mode)  # private to the user
        # Ray's own listeners (GCS, raylet, agents, metrics exporters) and the replicas' inter-deployment
        # gRPC servers (Serve binds those to [::]; serve/replica_grpc_bind.py) are on loopback too
        assert not non_loopback_listeners(psutil.Process(proc.pid))
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


def replica_of(root: psutil.Process) -> psutil.Process:
    (replica,) = [p for p in root.children(recursive=True) if "ServeReplica:k3ray:K3Server" in " ".join(p.cmdline())]
    return replica


def test_free_ports_come_from_outside_the_ephemeral_range_and_skip_taken_ones(monkeypatch):
    from k3ray.actors.serve import isolation as serve_isolation

    low, high = (int(p) for p in pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    first, last = serve_isolation.PORT_RANGE
    assert last <= low or first > high  # what bind(0) and outgoing connections draw from
    assert all(first <= serve_isolation.free_port() < last for _ in range(20))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="no free port"):
            serve_isolation.free_port((port, port + 1))
        free = serve_isolation.free_port()
        draws = iter([port, free])
        monkeypatch.setattr(serve_isolation, "random", types.SimpleNamespace(randrange=lambda *_: next(draws)))
        assert serve_isolation.free_port() == free  # the taken port drawn first is passed over


@pytest.mark.slow
def test_two_servers_on_one_host_never_answer_for_each_other(tiny_checkpoint, tmp_path, wait_until_serving):
    """Two `k3ray serve` on one machine, each with its own key: neither answers for the other, not
    while one has no replica (its HAProxy says 503, it has no fallback into the other's proxy) and not
    after one is SIGKILLed (its HAProxy dies with it, the port goes quiet, its runtime folder is
    removed). Two Ray instances: about 3 minutes here, so `slow`."""
    from k3ray.actors.serve.isolation import RUNTIME_PREFIX, RUNTIME_ROOT, remove_stale_runtime_dirs

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with serve_command(tiny_checkpoint, tmp_path / "a", "--api-key", "key-a") as (a, url_a, log_a, tree_a), \
            serve_command(tiny_checkpoint, tmp_path / "b", "--api-key", "key-b") as (b, url_b, log_b, tree_b):
        wait_until_serving(a, url_a, log_a, headers={"Authorization": "Bearer key-a"})
        wait_until_serving(b, url_b, log_b, headers={"Authorization": "Bearer key-b"})

        def status(url: str, key: str) -> int:
            return httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

        assert (status(url_a, "key-b"), status(url_b, "key-a")) == (401, 401)
        # A without a replica: its clients get A's 503 (retry), never B's 401 or B's completions
        replica_of(psutil.Process(a.pid)).kill()
        answers, deadline = set(), time.monotonic() + 120
        while status(url_a, "key-a") != 200:
            r = httpx.get(f"{url_a}/v1/models", headers={"Authorization": "Bearer key-b"}, timeout=30)
            answers.add(r.status_code)
            assert r.status_code in (401, 503), r.text  # 401: A's own app refusing B's key
            if r.status_code == 503:
                assert r.json()["error"]["type"] == "service_unavailable" and r.headers["retry-after"]
            assert time.monotonic() < deadline, "A's replica was not replaced"
            time.sleep(0.2)
        # SIGKILL A: its whole tree, HAProxy included, goes with it; B is untouched
        folder_a = list(pathlib.Path(RUNTIME_ROOT).glob(f"{RUNTIME_PREFIX}{a.pid}-*"))
        assert len(folder_a) == 1, folder_a
        tree_a[:] = psutil.Process(a.pid).children(recursive=True)
        haproxy_a = [p for p in tree_a if p.name() == "haproxy"]
        assert haproxy_a, "no HAProxy under A"
        a.kill()
        a.wait(timeout=60)
        _, alive = psutil.wait_procs(haproxy_a, timeout=60)
        assert not alive, "A's HAProxy outlived it"
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url_a}/v1/models", headers={"Authorization": "Bearer key-b"}, timeout=5)
        assert status(url_b, "key-b") == 200
        psutil.wait_procs([p for p in tree_a if p.is_running()], timeout=60)
        remove_stale_runtime_dirs()  # what the next server's start does (another's may have done it already)
        assert not folder_a[0].exists()
        print(f"isolation: A answered {sorted(answers)} to B's key while it had no replica")
