"""A disaggregated app's two deployments, as options: the prefill pool sized by its own bounds and
policy terms and routed by prefix affinity; the decode pool on its decode terms; bad bounds refused."""

import pytest
from pydantic import ValidationError

from k3ray.actors.serve.app import build_app, deployment_options, prefill_deployment_options
from k3ray.actors.serve.config import ServeArgs


def args(**disaggregation) -> ServeArgs:
    return ServeArgs.model_validate({"model": {"model": "/m"}, "autoscaling": {"max_replicas": 3},
                                     "disaggregation": disaggregation})


def policy(options: dict) -> dict:
    return options["autoscaling_config"]["policy"]["policy_kwargs"]


def test_each_pool_scales_on_its_own_terms_and_bounds():
    a = args(prefill_replicas=2, prefill_max_replicas=4, autoscale_itl_ms=300)
    prefill, decode = prefill_deployment_options(a), deployment_options(a)
    assert (prefill["autoscaling_config"]["min_replicas"], prefill["autoscaling_config"]["max_replicas"]) == (2, 4)
    assert policy(prefill)["role"] == "prefill"
    assert decode["autoscaling_config"]["max_replicas"] == 3
    terms = {k: policy(decode)[k] for k in ("role", "itl_target_ms", "running_per_replica")}
    assert terms == {"role": "decode", "itl_target_ms": 300.0, "running_per_replica": a.engine.max_num_seqs}
    assert "role" not in policy(deployment_options(args()))  # colocated: the terms it always had


def test_prefill_replicas_are_routed_by_prefix_affinity():
    options = prefill_deployment_options(args(prefill_replicas=1, prefill_max_replicas=2))
    assert options["request_router_config"].request_router_class.endswith("PrefixAffinityRequestRouter")
    assert options["max_queued_requests"] == -1
    assert "request_router_config" not in prefill_deployment_options(args(prefill_replicas=1))  # one replica


def test_the_app_has_a_prefill_deployment_only_when_asked():
    def deployments(app) -> set[str]:
        names, todo = set(), [app._bound_deployment]
        while todo:
            d = todo.pop()
            names.add(d.name)
            todo += [a._bound_deployment for a in d.init_args if hasattr(a, "_bound_deployment")]
        return names

    plain = {"model": {"model": "/m"}, "routing": {"request_router": "default"}}
    assert deployments(build_app(plain)) == {"K3Server"}
    assert deployments(build_app({**plain, "disaggregation": {"prefill_replicas": 1}})) == {"K3Server", "K3Prefill"}


@pytest.mark.parametrize("bad", [{"prefill_max_replicas": 2}, {"prefill_replicas": 3, "prefill_max_replicas": 2},
                                 {"handoff_attempts": 0}])
def test_bad_pool_bounds_are_refused(bad):
    with pytest.raises(ValidationError):
        args(**bad)
