"""k3ray-haproxy's rewrite of the config Serve writes for HAProxy (live: test_serve_cli, test_serve_errors)."""

from __future__ import annotations

from k3ray.actors.haproxy_wrapper import _config_path, k3ray_config

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


def test_config_path_is_the_value_of_dash_f():
    assert _config_path(["-db", "-f", "/tmp/x/haproxy.cfg", "-dR", "-sf", "12"]) == "/tmp/x/haproxy.cfg"
    assert _config_path(["-v"]) is None
