"""What a `k3ray serve` leaves running, and the reaper that stops it if the command itself dies
without stopping it (SIGKILL, the OOM killer).

A process of the server is one that carries its mark or was recorded in its process tree. Every
process the command starts, itself or through Ray (GCS, raylet, workers, HAProxy, engine
processes), inherits `K3RAY_SERVE_MARK=<pid>-<random>` in its environment, so it is found whoever
its parent is by then; the raylet starts its agents without that environment, so they are found
as recorded descendants of the command (pid and start time).

    mark = mark_this_process()                   # before Ray starts
    reaper = Reaper.start(mark, address=None)    # on a joined cluster: address= and app=
    recorded = descendants(os.getpid())          # serve; then, before stopping Serve and Ray:
    stop_processes(leftovers(mark, recorded))    # after: what outlived Ray's shutdown
    reaper.disarm()                              # a clean stop: the reaper has nothing to do

The reaper is a small process in a session of its own (a signal to the command's process group
does not reach it) that records the command's descendants every RECORD_S and waits on a pipe only
the command holds. End of file without the word `stopped` first means the command died: the
reaper stops every process of the server, and on a cluster the command joined it deletes the
command's app (nothing else).
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import subprocess
import sys
import tempfile
import threading

import psutil

from k3ray.actors.serve.isolation import remove_stale_runtime_dirs

MARK = "K3RAY_SERVE_MARK"
STOPPED = b"stopped\n"
EXIT_GRACE_S = 2.0  # Ray's agents leave on their own once their raylet is gone; most within this
TERM_GRACE_S = 2.0  # between SIGTERM and SIGKILL
APP_DELETE_TIMEOUT_S = 120.0  # the reaper gives up on an unreachable cluster
RECORD_S = 1.0


def mark_this_process() -> str:
    """Give this process (and so everything it starts from now on) a mark of its own; returns it."""
    mark = f"{os.getpid()}-{secrets.token_hex(6)}"
    os.environ[MARK] = mark
    return mark


def marked(mark: str) -> list[psutil.Process]:
    """The processes (of this user) started with `mark`, this one aside."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARK) == mark:
                found.append(process)
        except (psutil.Error, OSError):  # gone, or another user's
            continue
    return found


def descendants(pid: int) -> dict[int, float]:
    """{pid: start time} of every process below `pid` (none if it is gone), this one aside."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    found = {}
    for process in below:
        try:
            if process.pid != os.getpid():
                found[process.pid] = process.create_time()
        except psutil.Error:
            continue
    return found


def leftovers(mark: str, recorded: dict[int, float]) -> list[psutil.Process]:
    """The server's processes still running: those marked `mark`, and those `recorded` (a pid
    counts only with the start time it was recorded with: pids are reused)."""
    found = {p.pid: p for p in marked(mark)}
    for pid, started in recorded.items():
        try:
            process = psutil.Process(pid)
            if pid not in found and process.create_time() == started and process.is_running():
                found[pid] = process
        except psutil.Error:
            continue
    return list(found.values())


def stop_processes(processes: list[psutil.Process], grace_s: float = EXIT_GRACE_S) -> list[psutil.Process]:
    """Wait up to grace_s for processes to exit, then SIGTERM the rest and, TERM_GRACE_S later,
    SIGKILL them. -> the ones that had to be stopped, in the order given."""
    _, still_up = psutil.wait_procs(processes, timeout=grace_s)
    alive = [p for p in processes if p in still_up]
    for signal_them in (psutil.Process.terminate, psutil.Process.kill):
        for p in alive:
            try:
                signal_them(p)
            except psutil.NoSuchProcess:
                pass
        _, still = psutil.wait_procs(alive, timeout=TERM_GRACE_S)
        if not still:
            break
    return alive


class Reaper:
    """The command's handle on its reaper process."""

    def __init__(self, process: subprocess.Popen, pipe: int) -> None:
        self.process, self._pipe = process, pipe

    @classmethod
    def start(cls, mark: str, address: str | None = None, app: str | None = None) -> Reaper:
        """A reaper for the processes marked `mark` and, on the cluster at `address`, the app `app`."""
        read_end, write_end = os.pipe()  # not inherited: only this process holds the write end
        command = [sys.executable, "-m", "k3ray.actors.serve.reaper", mark, str(os.getpid())]
        if address is not None:
            assert app is not None, "a reaper on a joined cluster deletes the command's app: name it"
            command += ["--address", address, "--app", app]
        try:
            unmarked = {name: value for name, value in os.environ.items() if name != MARK}  # not one to stop
            process = subprocess.Popen(command, stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,
                                       env=unmarked, cwd=tempfile.gettempdir())  # off any checkout (see ray_connect)
        finally:
            os.close(read_end)
        return cls(process, write_end)

    def disarm(self) -> None:
        """The command stopped everything itself: the reaper exits without deleting anything."""
        if self._pipe < 0:
            return
        try:
            os.write(self._pipe, STOPPED)
        except OSError:  # the reaper is gone already
            pass
        os.close(self._pipe)
        self._pipe = -1
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def delete_app(address: str, app: str) -> None:
    """Delete `app` on the cluster at `address` (serve_launch.delete_app), leaving every other app
    and Serve itself running."""
    # lazy: Ray only to delete the app on a joined cluster: the reaper process starts in a blink
    import ray

    from k3ray.actors.cluster.ray_connect import connect
    from k3ray.actors.serve import launch as serve_launch

    connect(address=address, log_to_driver=False)
    try:
        serve_launch.delete_app(app)
    finally:
        ray.shutdown()


def _watch_command(command: int, recorded: dict[int, float]) -> bool:
    """Record the command's descendants into `recorded` every RECORD_S until its end of the pipe
    closes; True if it said it had stopped cleanly."""
    received = b""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], RECORD_S)
        if not ready:
            recorded.update(descendants(command))
            continue
        chunk = os.read(sys.stdin.fileno(), 64)
        if not chunk:
            return received == STOPPED
        received += chunk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3ray.actors.serve.reaper", description=__doc__)
    parser.add_argument("mark")
    parser.add_argument("command", type=int, help="the pid of the command (which died if it is not this parent)")
    parser.add_argument("--address")
    parser.add_argument("--app")
    args = parser.parse_args(argv)
    recorded: dict[int, float] = {}
    if os.getppid() == args.command and _watch_command(args.command, recorded):
        return 0
    left = stop_processes(leftovers(args.mark, recorded), grace_s=0)
    remove_stale_runtime_dirs()  # the command's (HAProxy's files), now that it is dead
    if left:
        print(f"k3ray serve: the command died; its reaper stopped {len(left)} process(es)", file=sys.stderr, flush=True)
    if args.address is not None:
        print(f"k3ray serve: the command died; its reaper deletes app {args.app!r} on {args.address}",
              file=sys.stderr, flush=True)
        give_up = threading.Timer(APP_DELETE_TIMEOUT_S, os._exit, args=(1,))
        give_up.daemon = True
        give_up.start()
        delete_app(args.address, args.app)
    return 0


if __name__ == "__main__":
    sys.exit(main())
