"""A replica's /metrics outside its request queue: a small HTTP server on a loopback port, in a
thread of the replica, that HAProxy routes `<route prefix>metrics` to (haproxy_wrapper), so a
Prometheus scrape is answered at once however many completions wait in the replica's queue.

The replica announces the port in a file of its server's runtime folder (serve_isolation), named
after its app and process: `metrics-<app>-<pid>.port`; HAProxy's config is rewritten whenever Serve
reloads it, which it does when a replica becomes ready. HAProxy checks the listener every second
at CHECK_PATH, which answers without rendering the metrics; it resets each check's connection once
it has read the status, which the listener takes quietly (it used to log a traceback every check).
"""

from __future__ import annotations

import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from k3ray.actors.serve.isolation import RUNTIME_PREFIX, RUNTIME_ROOT

RUNTIME_ENV = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"  # the server's runtime folder, inherited by its replicas
PORT_FILE = "metrics-{app}-{pid}.port"
CHECK_PATH = "/alive"


def runtime_dir() -> str | None:
    """This k3ray server's runtime folder, if the process runs under one with k3ray's HAProxy in
    front (a local haproxy ingress)."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return None
    path = os.environ.get(RUNTIME_ENV)
    inside = path and os.path.dirname(path) == RUNTIME_ROOT and os.path.basename(path).startswith(RUNTIME_PREFIX)
    return path if inside and os.path.isdir(path) else None


class QuietHTTPServer(ThreadingHTTPServer):
    """A client that goes away mid-answer (HAProxy's checks do, every time) is no error to report."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class MetricsListener:
    """Serves `render()` (-> (body, content type)) at GET /metrics on 127.0.0.1:<free port>, and
    "ok" at GET CHECK_PATH."""

    def __init__(self, render, app: str) -> None:
        self.folder = runtime_dir()
        assert self.folder is not None, "no k3ray runtime folder: nothing would route to the listener"

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?")[0]
                if path == CHECK_PATH:
                    body, content_type = b"ok", "text/plain"
                elif path.endswith("/metrics"):  # `<route prefix>metrics`
                    body, content_type = render()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # scrapes stay out of the replica's log
                pass

        self.server = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="k3ray-metrics", daemon=True).start()
        self.port_file = os.path.join(self.folder, PORT_FILE.format(app=app, pid=os.getpid()))
        with open(f"{self.port_file}.tmp", "w") as f:
            f.write(str(self.port))
        os.replace(f"{self.port_file}.tmp", self.port_file)

    def close(self) -> None:
        if os.path.exists(self.port_file):
            os.remove(self.port_file)
        self.server.shutdown()
        self.server.server_close()
