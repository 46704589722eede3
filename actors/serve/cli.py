"""`k3ray serve`: an OpenAI-compatible server for a K3 checkpoint on Ray Serve.

With no flags: a private local Ray instance, the tiny default model, http://127.0.0.1:8000,
until Ctrl-C or SIGTERM (then Serve and Ray are shut down; on a cluster joined with --address,
only this app is deleted; if the command is killed, its reaper, serve/reaper.py, does that). The flags are the settings of
k3ray.actors.serve.config, one per field; `--print-config` prints the Serve config YAML they make
(the same app for `serve deploy`, as cluster/serve-config.yaml) instead of serving.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import NoReturn

HELP = "serve a checkpoint with an OpenAI-compatible API on Ray Serve"


def add_arguments(p: argparse.ArgumentParser) -> None:
    # lazy: pydantic (the settings) stays out of `k3ray --help`
    from k3ray.actors.serve.flags import add_settings_flags

    p.add_argument("--print-config", action="store_true",
                   help="print the Serve config YAML of the other flags (every setting, with its default) and exit")
    add_settings_flags(p)


def app_args(args: argparse.Namespace) -> dict:
    """The app's args of the flags given (nested groups), the API key from $K3RAY_API_KEY if no --api-key."""
    # lazy: pydantic (the settings) stays out of `k3ray --help`
    from k3ray.actors.serve.flags import serve_args

    out = serve_args(args)
    if "api_key" not in out.get("server", {}) and os.environ.get("K3RAY_API_KEY"):
        out.setdefault("server", {})["api_key"] = os.environ["K3RAY_API_KEY"]
    return out


def main(args: argparse.Namespace) -> int:
    # lazy: pydantic (the settings) stays out of `k3ray --help`
    from pydantic import ValidationError

    from k3ray.actors.serve.config import APP_NAME, DEFAULT_INGRESS, LOOPBACK, ServeArgs
    from k3ray.actors.serve.flags import command_flags, launch_settings, serve_args

    try:
        launch = launch_settings(args)
        settings = ServeArgs.model_validate(serve_args(args))
    except ValidationError as e:
        raise ValueError(str(e)) from None
    if args.print_config:  # the flags given only: $K3RAY_API_KEY stays out of a printed file
        # lazy: pydantic (the settings) stays out of `k3ray --help`
        from k3ray.actors.serve.yaml_config import serve_config_yaml

        print(serve_config_yaml(settings, launch, command_flags(args)), end="")
        return 0
    # lazy: pydantic (the settings) stays out of `k3ray --help`
    from k3ray.actors.serve import preflight as serve_preflight

    # the port, the checkpoint and the layout are checked in seconds, before Ray and Serve start
    if launch.address is None:
        launch = launch.on_nodes([LOOPBACK])  # the local instance's one node
        serve_preflight.check_port(launch.host, launch.port)
    resolved = settings.resolved()
    serve_preflight.check_checkpoint(resolved)
    if launch.address is None:
        serve_preflight.check_layout(resolved, serve_preflight.local_resources(launch.num_cpus))

    # lazy: Ray loads after the preflight, never for --help or --print-config
    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve import reaper as serve_reaper

    # whatever this command starts carries its mark; the reaper stops it (or, on a joined cluster,
    # deletes the app) if this process dies without doing so
    mark = serve_reaper.mark_this_process()
    reaper = serve_reaper.Reaper.start(mark, launch.address, APP_NAME)
    # Ctrl-C / SIGTERM / SIGHUP only set a flag: one that lands inside Ray's own waits must not be
    # lost (it was, under load); Serve deploys on a thread of its own, so a hung deploy never holds
    # up the stop. Ray's processes are in process groups of their own (start_ray), so a signal to
    # this command's group reaches this process alone and the stop below runs in order
    stop = threading.Event()

    def request_stop(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts the shutdown

    def on_stop_signals() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, request_stop)

    on_stop_signals()
    owns_ray, failure = False, None
    try:
        init = {} if launch.num_cpus is None else {"num_cpus": launch.num_cpus}
        owns_ray = serve_launch.start_ray(launch.address, launch.ingress or DEFAULT_INGRESS, **init)
        on_stop_signals()  # Ray's driver set its own SIGTERM handler (it aborts the process)
        if launch.address is not None:
            # lazy: Ray loads after the preflight, never for --help or --print-config
            import ray

            launch = _joined(launch)
            serve_preflight.check_layout(resolved, ray.cluster_resources())
        deployed = _in_background(serve_launch.deploy, app_args(args), host=launch.host, port=launch.port,
                                  proxy_location=launch.proxy_location)
        while not stop.is_set() and not deployed.done():
            time.sleep(0.2)
        if deployed.done():
            print(f"k3ray serve: OpenAI API at {_deployed_url(deployed)}/v1 (Ctrl-C to stop)", flush=True)
        while not stop.is_set():
            time.sleep(0.2)
        print("k3ray serve: shutting down", file=sys.stderr, flush=True)
    except BaseException as e:
        failure = e
        raise
    finally:
        if not _stop_everything(owns_ray, mark, reaper, launch.stop_grace_s):
            _exit_now(1, failure)
    _exit_now(0)


def _joined(launch):
    """The launch settings for the joined cluster's nodes (host, proxies), after a warning line per
    node setting missing or different there; this process's Serve takes up the cluster's ingress."""
    # lazy: Ray loads after the preflight, never for --help or --print-config
    from k3ray.actors.cluster import node_check
    from k3ray.actors.serve import launch as serve_launch

    nodes = node_check.alive_nodes()
    launch = launch.on_nodes([node.address for node in nodes])
    running, problems = node_check.check_nodes()
    for line in problems:
        print(f"k3ray serve: warning: {line}", file=sys.stderr, flush=True)
    if problems:
        print("k3ray serve: warning: `k3ray cluster env` prints every node setting for `ray start`", file=sys.stderr,
              flush=True)
    serve_launch.use_ingress(running)
    print(f"k3ray serve: joined {len(nodes)} node(s) at {len({n.address for n in nodes})} address(es); ingress "
          f"{running}, --host {launch.host}, --proxy-location {launch.proxy_location}", file=sys.stderr, flush=True)
    return launch


def _stop_everything(owns_ray: bool, mark: str, reaper, grace_s: float) -> bool:
    """Stop Serve (the whole local instance, or only this app on a joined cluster) and Ray, then
    every process of this command still running; True if Serve and Ray stopped within grace_s
    (--stop-grace-s: requests in flight get that long to finish). The
    reaper is disarmed only then: otherwise it removes the runtime folder and, on a joined
    cluster, deletes the app again once this process has exited."""
    # lazy: Ray loads after the preflight, never for --help or --print-config
    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve import reaper as serve_reaper

    recorded = serve_reaper.descendants(os.getpid())
    recorded.pop(reaper.process.pid, None)
    stopping = _in_background(serve_launch.stop, owns_ray)
    try:
        stopping.result(timeout=grace_s)
        clean = True
    except TimeoutError:
        print(f"k3ray serve: Serve did not stop within {grace_s:g} s (--stop-grace-s); stopping its processes",
              file=sys.stderr, flush=True)
        clean = False
    except Exception as e:  # noqa: BLE001 - Ray and Serve raise many kinds; the processes are stopped below
        print(f"k3ray serve: stopping Serve failed ({type(e).__name__}: {e}); stopping its processes",
              file=sys.stderr, flush=True)
        clean = False
    stopped = serve_reaper.stop_processes(serve_reaper.leftovers(mark, recorded),
                                          serve_reaper.EXIT_GRACE_S if clean else 0)
    if stopped:
        print(f"k3ray serve: stopped {len(stopped)} process(es) that outlived Ray's shutdown", file=sys.stderr,
              flush=True)
    if clean:
        reaper.disarm()
    return clean


def _exit_now(code: int, failure: BaseException | None = None) -> NoReturn:
    """Exit once everything is stopped, without the interpreter's teardown: freeing torch and Ray
    took 5-10 s on a busy machine, and after an unclean stop Ray's exit handler would wait 60 s
    for a GCS that is gone. A ValueError under way is printed as the command prints one."""
    if isinstance(failure, ValueError):
        print(f"k3ray serve: error: {failure}", file=sys.stderr)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _in_background(fn, *args, **kwargs) -> Future:
    """fn(*args, **kwargs) on a daemon thread (the process may exit while it still waits)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=run, name="k3ray-serve-deploy", daemon=True).start()
    return future


def _deployed_url(deployed: Future) -> str:
    """The app's URL, or a ValueError in one line; it says to raise the start-up timeouts only when
    the proxy or a timeout failed (it said so after a replica's own error too)."""
    try:
        return deployed.result()
    except Exception as e:  # noqa: BLE001 - Ray and Serve raise many kinds; the message is what helps
        first = (str(e).strip().splitlines() or [""])[0][:300]
        timed_out = any(word in str(e).lower() for word in ("proxy", "timeout", "timed out"))
        hint = (f"on a slow or busy machine raise RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, now "
                f"{os.environ.get('RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S')} s, and RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S; "
                if timed_out else "")
        raise ValueError(f"the app did not start: {type(e).__name__}: {first} ({hint}the replica's log is under "
                         "/tmp/ray/session_latest/logs/serve)") from None


if __name__ == "__main__":  # `python -m k3ray.actors.serve.cli ...`, the same as `k3ray serve ...`
    parser = argparse.ArgumentParser(prog="k3ray serve", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
