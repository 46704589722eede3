"""The LLM-signal autoscaling policy (actors/serve/autoscaling.py) on Serve's own AutoscalingContext
and AutoscalingConfig, and what a replica reports (actors/serve/load_signals.py) on a clock the test
moves. The policy scaling a pipeline x expert-parallel app on a cluster is in
test_serve_llm_autoscale.py."""

from dataclasses import replace

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config  # Serve's wrapper
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from k3ray.actors.openai.admission import Admission, AdmissionLimits
from k3ray.actors.serve import load_signals as sig
from k3ray.actors.serve.autoscaling import STATE_KEY, LLMAutoscalingPolicy, serve_autoscaling_config
from k3ray.actors.serve.config import AutoscalingSettings
from k3ray.engine.stats import EngineStats

DEPLOYMENT = DeploymentID(name="K3Server", app_name="k3ray")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def context(reports: list[dict[str, float]], target: int | None = None, config: AutoscalingConfig | None = None,
            policy_state: dict | None = None) -> AutoscalingContext:
    """Serve's context for len(reports) running replicas, each having reported `reports[i]`."""
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(len(reports))]
    metrics: dict[str, dict] = {}
    for replica, report in zip(replicas, reports):
        for name, value in report.items():
            metrics.setdefault(name, {})[replica] = value
    config = config or AutoscalingConfig(min_replicas=1, max_replicas=8)
    return AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
        current_num_replicas=len(reports), target_num_replicas=len(reports) if target is None else target,
        running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state=dict(policy_state or {}),
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=config)


def report(queued: float = 0, cache: float = 0.0, ttft_p90: float = 0.0, ttft_count: float = 0) -> dict[str, float]:
    return {sig.QUEUED_TOKENS: queued, sig.CACHE_USAGE: cache, sig.TTFT_P90: ttft_p90, sig.TTFT_P50: ttft_p90 / 2,
            sig.TTFT_COUNT: ttft_count, sig.RUNNING: 0.0}


def stats(running: int, blocks: float, live_slots: int, total_slots: int) -> EngineStats:
    cache = {"block_usage": blocks, "state_slots_live": live_slots, "state_slots_total": total_slots}
    return EngineStats(num_running=running, num_waiting=1, num_steps=0, num_preemptions=0, prompt_tokens=0,
                       generation_tokens=0, cache=cache, prefix_cache_queries=0, prefix_cache_hits=0,
                       spec_draft_tokens=0, spec_accepted_tokens=0, spec_verifications=0, num_finished=0,
                       ttft_mean_s=None, ttft_p50_s=None, ttft_p99_s=None, tpot_mean_s=None)


POLICY = LLMAutoscalingPolicy(ttft_target_ms=1000, queued_tokens_per_replica=1000)


def test_queued_prompt_tokens_size_the_replicas_in_proportion():
    desired, state = POLICY(context([report(queued=3000), report(queued=1500)]))
    assert desired == pytest.approx(4.5) and state[STATE_KEY]["reason"] == "queued_tokens"
    # the same tokens on one replica ask for the same count: the work does not shrink with the replicas
    assert POLICY(context([report(queued=4500)]))[0] == pytest.approx(4.5)


def test_a_long_prompt_outweighs_many_short_requests():
    """One 6000-token prompt waiting asks for more than twenty 10-token requests."""
    one_long, _ = POLICY(context([report(queued=6000)]))
    many_short, _ = POLICY(context([report(queued=20 * 10)]))
    assert one_long == pytest.approx(6) and many_short == pytest.approx(0.2)


def test_ttft_over_target_scales_out_by_at_most_max_step():
    desired, state = POLICY(context([report(ttft_p90=1.5, ttft_count=4)] * 2))
    assert desired == pytest.approx(3.0) and state[STATE_KEY]["reason"] == "ttft"
    assert POLICY(context([report(ttft_p90=10.0, ttft_count=4)] * 2))[0] == pytest.approx(4.0)  # 2 x, not 20 x


def test_ttft_near_its_target_holds_the_replicas_and_stale_percentiles_are_ignored():
    assert POLICY(context([report(ttft_p90=0.8, ttft_count=3)] * 3))[0] == 3  # near the target: keep them
    assert POLICY(context([report(ttft_p90=0.3, ttft_count=3)] * 3))[0] == 0  # well under: no say
    assert POLICY(context([report(ttft_p90=5.0, ttft_count=0)] * 3))[0] == 0  # no first token in the window


def test_cache_usage_over_its_target_adds_replicas():
    desired, state = POLICY(context([report(cache=0.99), report(cache=0.9)]))
    assert desired == pytest.approx(2.1) and state[STATE_KEY]["reason"] == "cache_usage"


def test_without_reports_the_target_stays():
    desired, state = POLICY(context([{}, {}], target=3))
    assert desired == 3 and state[STATE_KEY]["reason"] == "no reports"


def test_the_policy_rejects_targets_that_cannot_work():
    with pytest.raises(ValueError):
        LLMAutoscalingPolicy(ttft_target_ms=0, queued_tokens_per_replica=10)
    with pytest.raises(ValueError):
        LLMAutoscalingPolicy(ttft_target_ms=100, queued_tokens_per_replica=0)


def test_serve_builds_the_policy_from_the_settings_and_applies_its_delays_and_bounds():
    """The settings give Serve a valid AutoscalingConfig whose policy Serve deserializes and calls
    with the settings' targets; Serve's wrapper scales up at once (upscale_delay_s 0), holds a
    scale-down for downscale_delay_s, and the bounds cap it."""
    settings = AutoscalingSettings(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=3600,
                                   autoscale_ttft_ms=500, autoscale_queued_tokens=100)
    config = AutoscalingConfig(**serve_autoscaling_config(settings))
    assert config.policy.policy_function == "k3ray.actors.serve.autoscaling:LLMAutoscalingPolicy"
    policy_cls = config.policy.get_policy()
    policy = _apply_autoscaling_config(policy_cls(**config.policy.policy_kwargs))
    up, state = policy(context([report(queued=350)], config=config))
    assert up == 4 and state[STATE_KEY]["queued_tokens"] == pytest.approx(3.5)
    held, _ = policy(context([report(), report(), report()], config=config, policy_state=state))
    assert held == 3  # idle, but downscale_delay_s has not passed
    assert min(max(up, config.min_replicas), config.max_replicas) == 4


def test_the_ongoing_requests_policy_stays_serves_default():
    settings = AutoscalingSettings(autoscale_policy="ongoing-requests", target_ongoing_requests=3, max_replicas=2)
    config = AutoscalingConfig(**serve_autoscaling_config(settings))
    assert config.policy.is_default_policy_function() and config.target_ongoing_requests == 3


def test_a_replica_reports_queued_tokens_cache_usage_and_recent_ttft_percentiles():
    clock = Clock()
    signals = sig.LoadSignals(window_s=10, clock=clock)
    idle_engine = stats(running=0, blocks=0.0, live_slots=0, total_slots=12)  # as of before the requests
    admission = Admission(AdmissionLimits(None, None, retry_after_s=1, long_prompt_tokens=16384, prefill_chunk_tokens=1024),
                          lambda: replace(idle_engine, as_of=-1.0), clock=clock, on_started=signals.observe_ttft)
    tickets = [admission.admit([100 * (i + 1)]) for i in range(10)]  # 100 .. 1000 prompt tokens
    for i, ticket in enumerate(tickets[:9]):
        clock.now += 0.1 * (i + 1)  # first tokens after 0.1, 0.3, 0.6, ... s
        admission.started(ticket)
        admission.started(ticket)  # a later output is not a first token
    out = signals.report(stats(running=9, blocks=0.25, live_slots=9, total_slots=12), admission.queued_tokens)
    assert out[sig.QUEUED_TOKENS] == 1000 and out[sig.RUNNING] == 9 and out[sig.WAITING] == 1
    assert out[sig.MLA_BLOCK_USAGE] == 0.25 and out[sig.KDA_SLOT_USAGE] == 0.75 and out[sig.CACHE_USAGE] == 0.75
    waits = sorted(sum(0.1 * (j + 1) for j in range(i + 1)) for i in range(9))
    assert out[sig.TTFT_COUNT] == 9
    assert out[sig.TTFT_P50] == pytest.approx(waits[4]) and out[sig.TTFT_P90] == pytest.approx(waits[8])
    assert all(isinstance(v, float) for v in out.values())  # what Serve accepts
    clock.now += 11  # the window passes: an idle replica reports no TTFT
    later = signals.report(stats(0, 0.0, 0, 12), 0)
    assert later[sig.TTFT_COUNT] == 0 and later[sig.TTFT_P90] == 0 and later[sig.QUEUED_TOKENS] == 0


# the two pools of a disaggregated app (serve/disaggregation.py) ----------------------------------
PREFILL = LLMAutoscalingPolicy(ttft_target_ms=1000, queued_tokens_per_replica=1000, role="prefill")
DECODE = LLMAutoscalingPolicy(ttft_target_ms=1000, queued_tokens_per_replica=1000, role="decode",
                              itl_target_ms=100, running_per_replica=4)


def load(queued: float = 0, cache: float = 0.0, running: float = 0, waiting: float = 0, ttft_p90: float = 0.0,
         ttft_count: float = 0, itl_p90: float | None = None, itl_count: float = 0) -> dict[str, float]:
    """A prefill replica's report (no ITL keys), or a decode replica's (with them)."""
    out = {**report(queued, cache, ttft_p90, ttft_count), sig.RUNNING: float(running), sig.WAITING: float(waiting)}
    if itl_p90 is not None:
        out.update({sig.ITL_P90: itl_p90, sig.ITL_COUNT: float(itl_count)})
    return out


def test_the_prefill_pool_is_sized_on_queued_prompt_tokens_and_ttft_only():
    """Long prompts waiting size it; its cache filling up with them, or its sequences, do not."""
    desired, state = PREFILL(context([load(queued=2500, cache=0.99, running=4), load(queued=500, cache=0.99)]))
    assert desired == pytest.approx(3.0) and state[STATE_KEY]["reason"] == "queued_tokens"
    assert set(state[STATE_KEY]) == {"reason", "queued_tokens", "ttft"}
    desired, state = PREFILL(context([load(ttft_p90=1.5, ttft_count=3, cache=0.99)] * 2))
    assert desired == pytest.approx(3.0) and state[STATE_KEY]["reason"] == "ttft"
    assert PREFILL(context([load(cache=0.99, running=4, itl_p90=9.0, itl_count=5)] * 2))[0] == 0  # idle prompts


def test_the_decode_pool_is_sized_on_cache_sequences_and_itl_only():
    """Queued prompt tokens and TTFT (the prefill pool's business) do not move it."""
    busy_prompts = load(queued=100_000, ttft_p90=30.0, ttft_count=9, itl_p90=0.0)
    desired, state = DECODE(context([busy_prompts] * 2))
    assert desired == 0 and set(state[STATE_KEY]) == {"reason", "cache_usage", "running", "itl"}
    desired, state = DECODE(context([load(cache=0.99, itl_p90=0.0), load(cache=0.9, itl_p90=0.0)]))
    assert desired == pytest.approx(2.1) and state[STATE_KEY]["reason"] == "cache_usage"
    desired, state = DECODE(context([load(running=4, itl_p90=0.0)] * 3))  # every slot decoding: hold
    assert desired == pytest.approx(3.0) and state[STATE_KEY]["reason"] == "running"


def test_decode_sequences_waiting_for_a_slot_add_decode_replicas():
    """Sequences beyond max_num_seqs wait in the replica's engine; the running term counts them
    (the running sequences alone can never ask for more replicas than there are)."""
    desired, state = DECODE(context([load(running=4, waiting=6, itl_p90=0.0)] * 2))
    assert desired == pytest.approx(5.0) and state[STATE_KEY]["reason"] == "running"


def test_inter_token_latency_over_target_scales_decode_out_and_near_it_holds():
    desired, state = DECODE(context([load(itl_p90=0.15, itl_count=40)] * 2))
    assert desired == pytest.approx(3.0) and state[STATE_KEY]["reason"] == "itl"
    assert DECODE(context([load(itl_p90=5.0, itl_count=40)] * 2))[0] == pytest.approx(4.0)  # at most MAX_STEP x
    assert DECODE(context([load(itl_p90=0.07, itl_count=40)] * 3))[0] == 3  # within HOLD of the target
    assert DECODE(context([load(itl_p90=5.0, itl_count=0)] * 3))[0] == 0  # no tokens in the window


def test_the_roles_policies_and_bounds_come_from_the_disaggregation_settings(tiny_checkpoint):
    from k3ray.actors.serve.app import deployment_options, prefill_deployment_options
    from k3ray.actors.serve.config import ServeArgs

    args = ServeArgs.model_validate({
        "model": {"model": tiny_checkpoint}, "engine": {"max_num_seqs": 6},
        "autoscaling": {"min_replicas": 1, "max_replicas": 3, "upscale_delay_s": 2, "autoscale_ttft_ms": 700},
        "disaggregation": {"prefill_replicas": 2, "prefill_max_replicas": 5, "autoscale_itl_ms": 80}}).resolved()
    decode = AutoscalingConfig(**deployment_options(args)["autoscaling_config"])
    prefill = AutoscalingConfig(**prefill_deployment_options(args)["autoscaling_config"])
    assert (decode.min_replicas, decode.max_replicas, prefill.min_replicas, prefill.max_replicas) == (1, 3, 2, 5)
    assert decode.upscale_delay_s == prefill.upscale_delay_s == 2
    decode_policy = decode.policy.get_policy()(**decode.policy.policy_kwargs)
    prefill_policy = prefill.policy.get_policy()(**prefill.policy.policy_kwargs)
    assert (decode_policy.role, decode_policy.itl_target_s, decode_policy.running_per_replica) == ("decode", 0.08, 6)
    assert (prefill_policy.role, prefill_policy.ttft_target_s) == ("prefill", 0.7)
    with pytest.raises(ValueError, match="role"):
        LLMAutoscalingPolicy(ttft_target_ms=100, queued_tokens_per_replica=10, role="both")
