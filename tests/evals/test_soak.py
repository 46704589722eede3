"""`k3ray bench soak` end to end: a private Serve app on loopback, a short mixed soak, and the keys
docs/benchmarks.md names (every request accounted for, memory sampled over the run)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)


def test_bench_soak_reports_errors_by_type_and_memory_over_time(tmp_path):
    out = tmp_path / "soak.json"
    argv = ["bench", "soak", "--num-prompts", "24", "--concurrency", "6", "--max-tokens", "4", "--memory-samples", "4",
            "--json", str(out)]
    # its own process (a private Ray + Serve), off the repository root
    run = subprocess.run([sys.executable, "-m", "k3ray.cli", *argv], capture_output=True, text=True, timeout=540,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"requests", "errors_by_type", "rss_mb_start", "rss_mb_end", "machine", "config"} <= set(result)
    assert result["requests"] == 24 and result["succeeded"] + sum(result["errors_by_type"].values()) == 24
    assert result["errors_by_type"] == {}, result["errors_by_type"]
    timeline = result["rss_mb_over_time"]
    assert timeline[0][0] == 0 and timeline[-1][0] == 24 and len(timeline) >= 4
    assert all(mb > 100 for _, mb in timeline)  # a replica and its engine process were measured


@pytest.mark.slow  # ~4 min: a pipeline 2 x expert-parallel 2 server, 90 s of load, a replica restarting
def test_bench_soak_chaos_loses_no_request_and_recovers_every_fault(tmp_path):
    out = tmp_path / "chaos.json"
    argv = ["bench", "soak", "--chaos", "--duration", "90", "--fault-every", "25", "--concurrency", "3",
            "--max-tokens", "4", "--json", str(out)]
    run = subprocess.run([sys.executable, "-m", "k3ray.cli", *argv], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"requests", "ok", "failed_503", "lost", "faults", "recovery_s", "outputs_identical"} <= set(result)
    assert result["ok"] + result["failed_503"] + result["lost"] == result["requests"]
    assert result["lost"] == 0 and result["outputs_identical"], result
    assert len(result["faults"]) >= 2 and result["recovery_s"] is not None, result["faults"]
    assert {f["target"] for f in result["faults"]} <= {"stage", "shard", "replica"}
