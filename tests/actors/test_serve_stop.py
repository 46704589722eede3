"""`k3ray serve` stops without leaving anything, fails fast on a bad checkpoint or a taken port,
and keeps quiet while idle.

- Stopping: SIGTERM to the command's process group, SIGKILL of the command (and, marked slow, SIGTERM
  to the command, SIGINT to the group; Ctrl-C to the command is test_serve_cli's) leave no process of
  the server running and nothing listening on its ports once the command (killed: its reaper) has
  exited.
- On a cluster it joined, the command deletes only its own app, on a clean stop and when it is
  killed (its reaper does it then): another app on the cluster keeps serving.
- A truncated or corrupt tensor file and a taken port end the command with one line naming the
  file or the port, before Ray is imported.
- An idle server logs no traceback (HAProxy's health checks of the metrics listener used to log
  one every second), and HAProxy binds nothing beyond loopback (its syslog socket was on 0.0.0.0).
"""

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

pytestmark = pytest.mark.timeout(600)
EXIT_WAIT_S = 120.0  # generous: a stop that hangs fails here; how long a stop takes is not checked
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
MARK = "K3RAY_SERVE_MARK"  # serve_reaper.MARK (the probe runs against the command as a subprocess)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def k3ray_serve(*flags: str) -> list[str]:
    # a loaded machine's Serve may take more than the default 8 s to stop gracefully: that exits 1, no bug
    return [sys.executable, "-m", "k3ray.cli", "serve", "--stop-grace-s", "120", *flags]


# ---------------------------------------------------------------------------------- failing fast

def truncated(checkpoint: str, into: pathlib.Path) -> tuple[str, str]:
    """A copy of the checkpoint with its second shard 1000 bytes short: (path, that file's name)."""
    into.mkdir()
    shards = sorted(f for f in pathlib.Path(checkpoint).iterdir() if f.suffix == ".safetensors")
    for f in pathlib.Path(checkpoint).iterdir():
        (into / f.name).symlink_to(f)
    (into / shards[1].name).unlink()
    (into / shards[1].name).write_bytes(shards[1].read_bytes()[:-1000])
    return str(into), shards[1].name


def corrupt(checkpoint: str, into: pathlib.Path) -> tuple[str, str]:
    """A copy of the checkpoint whose first shard's JSON header holds garbage."""
    path, _ = truncated(checkpoint, into)
    first = sorted(pathlib.Path(path).glob("*.safetensors"))[0]
    data = bytearray(first.read_bytes())
    first.unlink()
    data[8:20] = b"\xff not json \x00"
    first.write_bytes(bytes(data))
    return path, first.name


@pytest.mark.parametrize("case", ["truncated shard", "corrupt header", "taken port"])
def test_a_bad_checkpoint_or_a_taken_port_fails_in_one_line_before_ray(tiny_checkpoint, tmp_path, case,
                                                                       serve_error_line):
    """Before Ray is imported (serve_error_line checks it): the truncated shard used to fail after three
    replica attempts and 185 log lines; the taken port with its cause on line 16 of 105."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if case == "taken port":
            model, words = tiny_checkpoint, f"127.0.0.1:{port}: Address already in use"
        else:
            model, name = (truncated if case == "truncated shard" else corrupt)(tiny_checkpoint, tmp_path / "ckpt")
            model, words, port = model, f"{name}: not a complete safetensors file", free_port()
        line, _ = serve_error_line(["--model", model, "--port", str(port)], tmp_path)
    assert words in line, line


# ---------------------------------------------------------------------------- quiet when idle

def test_the_metrics_listener_takes_a_reset_check_quietly(monkeypatch, capfd):
    """HAProxy reads a check's status line and resets the connection: no traceback (there was one
    every second), and the check's own path answers without rendering the metrics."""
    from k3ray.actors.serve.isolation import make_runtime_dir, remove_runtime_dir
    from k3ray.actors.serve.metrics_listener import CHECK_PATH, MetricsListener

    folder = make_runtime_dir()
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", folder)
    renders = []

    def render() -> tuple[bytes, str]:
        renders.append(1)
        return b"k3ray_metric 1\n" * 200_000, "text/plain"  # 3 MB: the reset lands mid-answer

    listener = MetricsListener(render, "k3ray")
    try:
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", listener.port)) as s:
                s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                assert s.recv(12).startswith(b"HTTP/1.0 200")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        r = httpx.get(f"http://127.0.0.1:{listener.port}{CHECK_PATH}", timeout=10)
        assert (r.status_code, r.text, len(renders)) == (200, "ok", 5)
        time.sleep(0.5)  # the handler threads meet the resets
    finally:
        listener.close()
        remove_runtime_dir(folder)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err, err[-2000:]


def test_haproxy_log_goes_to_a_ring_not_to_udp_on_loopback():
    from k3ray.actors.serve.haproxy_wrapper import LOG_RING, with_log_ring

    config = ("global\n    log 127.0.0.1:514 local0 info\n    log /run/x/metrics.sock len 8192 format rfc5424 local1 debug\n"
              "    stats socket /run/x/admin.sock mode 600 level admin\n\ndefaults\n    log global\n")
    out = with_log_ring(config)
    assert f"    log ring@{LOG_RING} local0 info\n" in out and "127.0.0.1:514" not in out
    assert "log /run/x/metrics.sock" in out  # a Unix socket target stays
    assert out.index(f"\nring {LOG_RING}\n") < out.index("\ndefaults\n") and with_log_ring(out) == out
    remote = config.replace("127.0.0.1:514", "10.1.2.3:514")
    assert with_log_ring(remote) == remote  # a syslog elsewhere is the operator's choice


# ---------------------------------------------------------------------------------- the reaper

COMMAND = """
import os, subprocess, sys, time
from k3ray.actors.serve import reaper as serve_reaper
mark = serve_reaper.mark_this_process()
reaper = serve_reaper.Reaper.start(mark)
sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
marked = subprocess.Popen(sleep)  # like Ray's processes: it inherits the mark
unmarked = subprocess.Popen(sleep, env={k: v for k, v in os.environ.items() if k != serve_reaper.MARK})  # like Ray's agents
print(reaper.process.pid, marked.pid, unmarked.pid, flush=True)
if sys.stdin.readline().strip() == "disarm":
    reaper.disarm()
    print("disarmed", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def command_with_reaper(tmp_path):
    """A process that marks itself, starts a reaper and two children (one marked, one not): yields
    (command, reaper, marked child, unmarked child); all of them are gone afterwards."""
    command = subprocess.Popen([sys.executable, "-c", COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, cwd=tmp_path)
    processes = [command]
    try:
        processes += [psutil.Process(int(pid)) for pid in command.stdout.readline().split()]
        yield tuple(processes)
    finally:
        for p in processes:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                p.kill()
        command.wait(timeout=60)


def test_the_reaper_stops_a_killed_commands_processes(tmp_path):
    with command_with_reaper(tmp_path) as (command, reaper, marked, unmarked):
        time.sleep(2.5)  # the reaper has recorded the command's children
        command.kill()
        _, alive = psutil.wait_procs([marked, unmarked, reaper], timeout=EXIT_WAIT_S)
        assert not alive, alive


def test_a_disarmed_reaper_leaves_and_stops_nothing(tmp_path):
    with command_with_reaper(tmp_path) as (command, reaper, marked, unmarked):
        command.stdin.write("disarm\n")
        command.stdin.flush()
        assert command.stdout.readline() == "disarmed\n"
        assert not reaper.is_running() or reaper.status() == psutil.STATUS_ZOMBIE
        command.kill()
        time.sleep(1.5)
        assert marked.is_running() and unmarked.is_running()


# ------------------------------------------------------------------------------ a real server

def server_processes(pid: int, recorded: dict[int, float]) -> list[psutil.Process]:
    """The server's processes still running: those `recorded` ({pid: start time}) and those that
    carry its mark, whoever their parent is now."""
    found = {}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if recorded.get(p.pid) == p.create_time() or p.environ().get(MARK, "").startswith(f"{pid}-"):
                if p.status() != psutil.STATUS_ZOMBIE:
                    found[p.pid] = p
    return list(found.values())


def record(pid: int) -> dict[int, float]:
    """{pid: start time} of the process and everything below it."""
    root = psutil.Process(pid)
    return {p.pid: p.create_time() for p in [root, *root.children(recursive=True)]}


def listening_ports(processes: list[psutil.Process]) -> set[int]:
    ports = set()
    for p in processes:
        with contextlib.suppress(psutil.Error):
            ports |= {c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    return ports


def listeners_on(ports: set[int], since: float) -> list[str]:
    """Listening sockets on `ports`, but for those of processes started after `since` (another
    server on the machine may take a port the stopped one freed)."""
    def older(pid: int | None) -> bool:
        with contextlib.suppress(psutil.Error):
            return pid is None or psutil.Process(pid).create_time() <= since
        return False

    return [f"{c.laddr.ip}:{c.laddr.port} (pid {c.pid})" for c in psutil.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports and older(c.pid)]


def described(processes: list[psutil.Process]) -> list[str]:
    out = []
    for p in processes:
        with contextlib.suppress(psutil.Error):
            out.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
    return out


@contextlib.contextmanager
def serving(checkpoint: str, tmp_path, *flags: str, local: bool = True):
    """`k3ray serve` in a session of its own (its process group is its pid) on a free loopback port,
    until it answers: yields (process, url, log path, {pid: start time} of its processes, updated by
    the test). Whatever of it still runs afterwards is killed."""
    port = free_port()
    local_flags = ("--num-cpus", "4") if local else ()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(k3ray_serve("--model", checkpoint, "--port", str(port), "--max-model-len", "128",
                                            "--cache-memory-mb", "16", *local_flags, *flags),
                                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    recorded: dict[int, float] = {}
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while "k3ray serve: OpenAI API at" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        recorded.update(record(proc.pid))
        yield proc, url, log_path, recorded
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        left = server_processes(proc.pid, recorded)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()


def reaper_of(recorded: dict[int, float]) -> psutil.Process:
    """The command's reaper (serve/reaper.py), among its recorded processes."""
    for pid, started in recorded.items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.create_time() == started and "k3ray.actors.serve.reaper" in " ".join(process.cmdline()):
                return process
    raise AssertionError("the command started no reaper")


def wait_exited(process: psutil.Process, what: str) -> None:
    """Until `process` has exited (a zombie counts: its parent may be slow to reap it)."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"{what} did not exit"
                time.sleep(0.2)
                continue
        return


def assert_nothing_left(proc, recorded: dict[int, float], ports: set[int], stopped_at: float) -> None:
    """No process of the server runs and nothing listens on its ports: checked once, when what stops
    the server (the command; its reaper if the command was killed) has exited."""
    left = server_processes(proc.pid, recorded)
    listening = listeners_on(ports, since=stopped_at)
    assert not left and not listening, f"processes {described(left)}, listeners {listening}"


def haproxy_sockets(processes: list[psutil.Process]) -> list[str]:
    """`kind ip:port` of every internet socket (TCP and UDP) HAProxy holds."""
    found = [p for p in processes if p.name() == "haproxy"]
    assert found, "no HAProxy process"
    return [f"{c.type.name} {c.laddr.ip}:{c.laddr.port}" for p in found for c in p.net_connections("inet") if c.laddr]


class InFlight:
    """A streamed completion on a thread: `started` once its first chunk is in; then its finish
    reason, or the error that cut it."""

    def __init__(self, url: str, max_tokens: int) -> None:
        import threading

        self.url, self.max_tokens = url, max_tokens
        self.started, self.finish, self.error = threading.Event(), None, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import json

        body = {"prompt": "hi", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.started.set()
                        self.finish = json.loads(line[6:])["choices"][0].get("finish_reason") or self.finish
        except httpx.HTTPError as e:
            self.error = repr(e)
        finally:
            self.started.set()


STOPS = {
    "SIGTERM to its process group": lambda pid: os.killpg(pid, signal.SIGTERM),
    "SIGKILL to the command": lambda pid: os.kill(pid, signal.SIGKILL),
    "SIGTERM to the command": lambda pid: os.kill(pid, signal.SIGTERM),
    "SIGINT to its process group": lambda pid: os.killpg(pid, signal.SIGINT),
}
SLOW_STOPS = ("SIGTERM to the command", "SIGINT to its process group")  # the same path as the two above


@pytest.mark.parametrize("stop", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_STOPS else s for s in STOPS])
def test_a_stopped_server_leaves_no_process_and_no_listener(tiny_checkpoint, tmp_path, stop):
    """SIGTERM to the group used to kill GCS and the raylet first: the proxy, controller, replica,
    engine process and HAProxy lived on for 60 s. The group case first idles ~20 s: its log must hold
    no traceback, and HAProxy must hold no socket beyond loopback. A stream in flight when the stop
    begins is finished (Serve's shutdown used to stop HAProxy first and cut it), unless the command
    is killed."""
    with serving(tiny_checkpoint, tmp_path) as (proc, url, log_path, recorded):
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
        processes = server_processes(proc.pid, recorded)
        ports = listening_ports(processes) | {int(url.rsplit(":", 1)[1])}
        if stop == "SIGTERM to its process group":
            logged = len(log_path.read_text())
            time.sleep(20)
            idle_log = log_path.read_text()[logged:]
            assert "Traceback" not in idle_log and "ConnectionResetError" not in idle_log, idle_log[-3000:]
            outside = [s for s in haproxy_sockets(processes) if s.split()[1].rsplit(":", 1)[0] not in LOOPBACK]
            assert not outside, outside
        recorded.update(record(proc.pid))
        killed = stop == "SIGKILL to the command"
        reaper = reaper_of(recorded)
        stream = InFlight(url, max_tokens=100)
        assert stream.started.wait(60) and stream.error is None, stream.error
        stopped_at = time.time()
        STOPS[stop](proc.pid)
        proc.wait(timeout=EXIT_WAIT_S)
        wait_exited(reaper, "the reaper")  # a clean stop disarms it; a killed command's processes are its
        assert_nothing_left(proc, recorded, ports, stopped_at)
        assert proc.returncode == (-signal.SIGKILL if killed else 0), log_path.read_text()[-3000:]
        stream.thread.join(timeout=60)
        if not killed:
            assert (stream.finish, stream.error) == ("length", None), log_path.read_text()[-3000:]
        print(f"{stop}: nothing of the server left; the stream in flight: {stream.finish}, {stream.error}")


# --------------------------------------------------------------------------- a joined cluster

def connected_to(ray_cluster) -> str:
    """The test process as a driver of the session's loopback cluster; its address."""
    import ray

    from k3ray.actors.cluster.ray_connect import connect

    cluster, _ = ray_cluster
    if ray.is_initialized() and ray.get_runtime_context().gcs_address != cluster.address:
        ray.shutdown()
    if not ray.is_initialized():
        connect(address=cluster.address, log_to_driver=False)
    return cluster.address


def live_placement_groups() -> set[str]:
    import ray

    return {pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def test_on_a_joined_cluster_only_the_commands_app_goes(ray_cluster, tiny_checkpoint, tmp_path):
    """`k3ray serve --address` used to shut Serve down for the whole cluster on Ctrl-C. Another app,
    with a placement group of its own, keeps serving through the same proxy when the command is stopped
    (Ctrl-C: it exits 0) and when it is killed (its reaper deletes the app)."""
    from ray import serve

    from k3ray.actors.serve import launch as serve_launch

    address = connected_to(ray_cluster)
    port = free_port()

    @serve.deployment(placement_group_bundles=[{"CPU": 0.1}], ray_actor_options={"num_cpus": 0.1})
    class Other:
        def __call__(self, request) -> str:
            return "other"

    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        serve.run(Other.bind(), name="other", route_prefix="/other")
        before = live_placement_groups()
        assert before, "the other app holds a placement group"

        def other_serves() -> bool:
            return httpx.get(f"http://127.0.0.1:{port}/other", timeout=30).text == "other"

        for stop in ("SIGINT", "SIGKILL"):
            run_dir = tmp_path / stop
            run_dir.mkdir()
            with serving(tiny_checkpoint, run_dir, "--address", address, local=False) as (proc, _, log_path, _):
                deadline = time.monotonic() + 120
                while httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code != 200:
                    assert time.monotonic() < deadline, "the command's app does not answer through the proxy"
                    time.sleep(1)
                assert set(serve.status().applications) == {"other", "k3ray"}
                t0 = time.monotonic()
                os.kill(proc.pid, getattr(signal, stop))
                if stop == "SIGINT":
                    assert proc.wait(timeout=EXIT_WAIT_S) == 0, log_path.read_text()[-3000:]
                deadline = time.monotonic() + 60
                while "k3ray" in serve.status().applications:
                    assert time.monotonic() < deadline, f"after {stop} the app is still there: {log_path.read_text()[-3000:]}"
                    time.sleep(0.5)
                print(f"{stop}: the app was gone after {time.monotonic() - t0:.1f} s")
            assert set(serve.status().applications) == {"other"} and other_serves()
            assert live_placement_groups() == before  # the other app's is there, none of the command's
    finally:
        serve_launch.shutdown_serve()
