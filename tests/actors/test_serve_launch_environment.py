"""What start_ray sets for a local instance (its ports, runtime folder, ingress flags) is undone when
the instance stops, so a process that serves twice (a test session) starts each from a clean slate."""

import os

from k3ray.actors.serve import launch as serve_launch
from k3ray.actors.serve.isolation import remove_runtime_dir


def settings() -> dict:
    return {"env": dict(os.environ),
            "flags": [getattr(m, n) for m, n in ((serve_launch.serve_constants, "RAY_SERVE_ENABLE_HA_PROXY"),
                                                 (serve_launch.serve_build_app, "RAY_SERVE_ENABLE_HA_PROXY"),
                                                 (serve_launch.ray_constants, "ENABLE_RAY_CLUSTER"))]}


def test_a_local_instances_settings_are_put_back(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "kept")  # a set variable comes back as it was
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)  # an unset one is unset again
    before = settings()
    serve_launch.prepare_local("proxy")
    runtime_dir = os.environ["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"]
    try:
        assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0" and os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
        cluster = before["env"].get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == cluster  # loopback unless the user asked
        assert settings()["flags"] == [False, False, cluster not in ("0", "false", "False")]
        serve_launch.prepare_local("proxy")  # prepared twice: the first old values are what comes back
    finally:
        remove_runtime_dir(runtime_dir)
        remove_runtime_dir(os.environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE"))
        serve_launch.restore_environment()
    assert settings() == before
