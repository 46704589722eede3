"""`k3ray serve`: an OpenAI-compatible server for a K3 checkpoint on Ray Serve.

With no flags: a private local Ray instance, the tiny default model, http://127.0.0.1:8000,
until Ctrl-C (then Serve and Ray are shut down). The flags are the settings of
k3ray.actors.serve_config, one per field; `--print-config` prints the Serve config YAML they make
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

HELP = "serve a checkpoint with an OpenAI-compatible API on Ray Serve"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from k3ray.actors.serve_flags import add_settings_flags

    p.add_argument("--print-config", action="store_true",
                   help="print the Serve config YAML of the other flags (every setting, with its default) and exit")
    add_settings_flags(p)


def app_args(args: argparse.Namespace) -> dict:
    """The app's args of the flags given (nested groups), the API key from $K3RAY_API_KEY if no --api-key."""
    from k3ray.actors.serve_flags import serve_args

    out = serve_args(args)
    if "api_key" not in out.get("server", {}) and os.environ.get("K3RAY_API_KEY"):
        out.setdefault("server", {})["api_key"] = os.environ["K3RAY_API_KEY"]
    return out


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from k3ray.actors.serve_config import DEFAULT_INGRESS, ServeArgs
    from k3ray.actors.serve_flags import command_flags, launch_settings, serve_args

    try:
        launch = launch_settings(args)
        settings = ServeArgs.model_validate(serve_args(args))
    except ValidationError as e:
        raise ValueError(str(e)) from None
    if args.print_config:  # the flags given only: $K3RAY_API_KEY stays out of a printed file
        from k3ray.actors.serve_yaml import serve_config_yaml

        print(serve_config_yaml(settings, launch, command_flags(args)), end="")
        return 0
    from k3ray.actors import serve_preflight

    # the checkpoint and the layout are checked in seconds, before Ray and Serve start
    resolved = settings.resolved()
    serve_preflight.check_checkpoint(resolved)
    if launch.address is None:
        serve_preflight.check_layout(resolved, serve_preflight.local_resources(launch.num_cpus))

    from k3ray.actors import serve_launch

    init = {} if launch.num_cpus is None else {"num_cpus": launch.num_cpus}
    owns_ray = serve_launch.start_ray(launch.address, launch.ingress or DEFAULT_INGRESS, **init)
    # Ctrl-C / SIGTERM only set a flag: one that lands inside Ray's own waits must not be lost (it
    # was, under load); Serve deploys on a thread of its own, so a hung deploy never holds up the stop
    stop = threading.Event()

    def request_stop(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts the shutdown

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        if launch.address is not None:
            import ray

            serve_preflight.check_layout(resolved, ray.cluster_resources())
        deployed = _in_background(serve_launch.deploy, app_args(args), host=launch.host, port=launch.port)
        while not stop.is_set() and not deployed.done():
            time.sleep(0.2)
        if deployed.done():
            print(f"k3ray serve: OpenAI API at {_deployed_url(deployed)}/v1 (Ctrl-C to stop)", flush=True)
        while not stop.is_set():
            time.sleep(0.2)
        print("k3ray serve: shutting down", file=sys.stderr, flush=True)
    finally:
        import psutil

        started = psutil.Process().children(recursive=True) if owns_ray else []  # Ray's, all of them
        serve_launch.stop(owns_ray)
        stopped = serve_launch.reap_leftovers(started)
        if stopped:
            print(f"k3ray serve: stopped {len(stopped)} Ray process(es) that outlived Ray's shutdown",
                  file=sys.stderr, flush=True)
    return 0


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
    """The app's URL, or a ValueError in one line that says what to raise on a slow machine."""
    try:
        return deployed.result()
    except Exception as e:  # noqa: BLE001 - Ray and Serve raise many kinds; the message is what helps
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"the app did not start: {type(e).__name__}: {first} (on a slow or busy machine raise "
            f"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, now {os.environ.get('RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S')} s, "
            "and RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S; the replica's log is under /tmp/ray/session_latest/logs/serve)"
        ) from None


if __name__ == "__main__":  # `python -m k3ray.actors.serve_cli ...`, the same as `k3ray serve ...`
    parser = argparse.ArgumentParser(prog="k3ray serve", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
