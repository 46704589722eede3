"""`k3ray bench serve --workload ramp` (actors/bench/serve/ramp.py): the ramp's arrival schedule, the
replica timeline's figures, and the flags; a whole run (two Serve apps) is `slow`."""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from k3ray.actors.bench.serve import cli, ramp


def test_the_rate_holds_then_rises_linearly_then_holds():
    rates = [ramp.rate_at(t, 1.0, 5.0, warm_s=10, ramp_s=8) for t in (0, 9.9, 10, 14, 18, 100)]
    assert rates == [1.0, 1.0, 1.0, 3.0, 5.0, 5.0]


def test_arrivals_follow_the_ramp_and_repeat_with_their_seed():
    offsets = ramp.ramp_offsets(0.5, 8.0, warm_s=200, ramp_s=100, hold_s=200, seed=3)
    assert offsets == ramp.ramp_offsets(0.5, 8.0, warm_s=200, ramp_s=100, hold_s=200, seed=3)
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < 500
    times = np.array(offsets)
    warm, hold = np.sum(times < 200) / 200, np.sum(times >= 300) / 200
    assert warm == pytest.approx(0.5, rel=0.25) and hold == pytest.approx(8.0, rel=0.1)
    rising = np.sum((times >= 200) & (times < 300))
    assert rising == pytest.approx(100 * (0.5 + 8.0) / 2, rel=0.15)  # the area under the ramp


def test_a_ramp_needs_positive_rates_rising():
    with pytest.raises(ValueError):
        ramp.ramp_offsets(2.0, 1.0, 1, 1, 1, 0)
    with pytest.raises(ValueError):
        ramp.ramp_offsets(0.0, 1.0, 1, 1, 1, 0)


def test_the_timeline_gives_the_decision_and_scale_up_times_and_the_replica_seconds():
    watch = ramp.ReplicaWatch()
    watch.timeline = [(0.0, 1, 1), (5.0, 1, 2), (12.5, 2, 2), (20.0, 2, 2)]
    assert watch.first_time_with(2) == 12.5 and watch.first_time_with(3) is None
    assert watch.first_time_with(2, running=False) == 5.0
    assert watch.replica_seconds() == pytest.approx(5 + 7.5 + 2 * 7.5)


def test_figures_are_medians_over_rounds_and_a_run_that_never_scaled_counts_as_slowest():
    runs = [{"scale_up_s": 30.0, "f": 0.5}, {"scale_up_s": None, "f": 0.1}, {"scale_up_s": 20.0, "f": 0.3}]
    assert ramp.median_of(runs, "scale_up_s") == 30.0 and ramp.median_of(runs, "f") == 0.3
    assert ramp.median_of(runs[:2], "scale_up_s") is None and ramp.median_of(runs[:1], "f") == 0.5


def test_the_ramp_flags_parse_and_lengths_default_per_workload():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--workload", "ramp", "--peak-rate", "3", "--ttft-slo-ms", "500"])
    assert args.workload == "ramp" and args.peak_rate == 3 and args.ttft_slo_ms == 500
    assert args.input_len is None and parser.parse_args([]).workload == "levels"
    policy_args = ramp.serve_args(args, "llm", 4096, 8)
    assert policy_args["autoscaling"]["autoscale_policy"] == "llm"
    assert policy_args["autoscaling"]["autoscale_ttft_ms"] == 500
    assert policy_args["engine"]["max_model_len"] == 4096 + 8 + 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_ramp_runs_both_policies(tmp_path):
    """A whole run, shortened: both policies' apps start, take the ramp and report the keys."""
    out = tmp_path / "ramp.json"
    subprocess.run([sys.executable, "-m", "k3ray.cli", "bench", "serve", "--workload", "ramp", "--prompt-tokens", "512",
                    "--base-rate", "1", "--peak-rate", "4", "--warm-s", "2", "--ramp-s", "3", "--hold-s", "5",
                    "--json", str(out)], check=True, cwd=tmp_path, timeout=850)
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"llm", "ongoing-requests"}
    for (run,) in result["runs"].values():  # one round
        assert run["requests"] > 10 and run["failed"] == 0 and run["replicas"][0][1] >= 1
        assert run["scale_up_s"] is None or run["decision_s"] <= run["scale_up_s"]
    assert 0 <= result["slo_violation_frac"] <= 1 and 0 <= result["baseline_slo_violation_frac"] <= 1
