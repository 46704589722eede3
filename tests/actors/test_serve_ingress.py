"""k3ray-haproxy's rewrite of the config Serve writes for HAProxy, and the environment each ingress
starts Ray with (live: test_serve_cli, test_serve_errors)."""

from __future__ import annotations

import os

import pytest

from k3ray.actors.haproxy_wrapper import _config_path, k3ray_config
from k3ray.actors.serve_launch import ingress_environment

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


def test_ingress_environment(monkeypatch):
    assert ingress_environment("proxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    with pytest.raises(ValueError, match="ingress must be one of"):
        ingress_environment("nginx")
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"):
        monkeypatch.delenv(name, raising=False)
    env = ingress_environment("haproxy")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    wrapper = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert os.path.isabs(wrapper) and os.access(wrapper, os.X_OK) and wrapper.endswith("k3ray-haproxy")
    # free ports unless set, so a second server on the machine does not collide on 8404 / 9101
    stats, metrics = int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])
    assert stats > 0 and metrics > 0
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    assert ingress_environment("haproxy")["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
