"""`k3ray bench serve`: arrival schedules, the metric arithmetic on hand-made timings, the datasets,
and one tiny end-to-end run that starts k3ray's Serve app on loopback, measures it and stops it."""

import asyncio
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from k3ray.actors.bench.serve import datasets, metrics
from k3ray.actors.bench.serve.client import RequestResult
from k3ray.actors.bench.serve.load import arrival_offsets, run_load
from k3ray.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(600)
LEVEL_KEYS = {"concurrency", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms"}
VLLM_KEYS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
             "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "queue_times", "generated_texts", "errors"}
VLLM_KEYS |= {f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p50", "p99")
              for metric in ("ttft", "tpot", "itl", "e2el")}


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_are_gamma_with_the_requested_rate(burstiness):
    rate, n = 20.0, 40_001
    offsets = np.array(arrival_offsets(n, rate, burstiness, seed=1))
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and (gaps >= 0).all()
    # the mean of 40k gamma gaps has relative std 1/sqrt(k * n) <= 1%: 5 sigma
    assert gaps.mean() == pytest.approx(1 / rate, rel=5 / math.sqrt(burstiness * (n - 1)))
    # coefficient of variation 1/sqrt(burstiness): the knob that makes arrivals bursty (< 1) or even (> 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert arrival_offsets(10, rate, burstiness, seed=1) == arrival_offsets(10, rate, burstiness, seed=1)


def test_bad_load_settings_are_refused():
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, burstiness=0.0)
    with pytest.raises(ValueError, match="--goodput"):
        metrics.parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match="milliseconds"):
        metrics.parse_goodput(["ttft:fast"])
    assert metrics.parse_goodput(["ttft:500", "tpot:50", "e2el:2e3"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}


def test_the_load_loop_keeps_the_cap_and_the_schedule():
    requests = [datasets.BenchRequest((1, 2, 3), 2) for _ in range(8)]
    in_flight, peak = 0, 0

    async def send(request):
        nonlocal in_flight, peak
        result = RequestResult(prompt_len=request.prompt_len, start_time=asyncio.get_running_loop().time())
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return result

    offsets = [0.0] * 4 + [0.1] * 4
    results, duration = asyncio.run(run_load(send, requests, offsets, max_concurrency=3))
    assert peak == 3 and len(results) == 8 and duration >= 0.1


def timed(prompt_len, start, ttft, itl, output_tokens, success=True):
    latency = ttft + sum(itl)
    return RequestResult(prompt_len=prompt_len, success=success, output_tokens=output_tokens, ttft=ttft,
                         itl=list(itl), latency=latency, start_time=start)


def test_metrics_follow_vllms_definitions():
    results = [
        timed(10, 0.0, 0.1, [0.05, 0.05, 0.1], 4),  # tpot (0.3 - 0.1) / 3
        timed(20, 0.5, 0.3, [0.25], 2),  # tpot 0.25
        timed(5, 0.0, 0.2, [], 1),  # one token: no tpot, counted as 0 for goodput
        RequestResult(prompt_len=7, error="HTTP 500"),
    ]
    m = metrics.calculate_metrics(results, duration=2.0, percentiles=[50, 99], goodput={"ttft": 250, "tpot": 100})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 7)
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 3.5 and m["total_token_throughput"] == 21.0
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx((200 / 3 + 250) / 2)
    assert m["mean_itl_ms"] == pytest.approx(112.5) and m["p50_itl_ms"] == pytest.approx(75.0)
    assert m["mean_e2el_ms"] == pytest.approx((300 + 550 + 200) / 3)
    assert m["p99_e2el_ms"] == pytest.approx(float(np.percentile([300, 550, 200], 99)))
    # ttft <= 250 ms and tpot <= 100 ms: the first and the one-token request
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    # requests 1 and 3 overlap from t=0; request 2 runs 0.5-1.05, after both ended
    assert m["max_concurrent_requests"] == 2
    # second 0 holds chunks at 0.1, 0.15, 0.2, 0.3 (request 1), 0.2 (request 3), 0.8 (request 2); 1.05 is in second 1
    assert m["max_output_tokens_per_s"] == 6.0
    assert metrics.calculate_metrics(results, 2.0)["request_goodput"] is None
    lists = metrics.per_request_lists(results)
    assert lists["output_lens"] == [4, 2, 1, 0] and lists["errors"][3] == "HTTP 500"


def test_random_prompts_have_the_requested_lengths_and_ordinary_tokens():
    requests = datasets.random_requests(50, 32, 8, token_range=(0, 256), range_ratio=0.5, seed=3)
    assert all(16 <= r.prompt_len <= 48 and 4 <= r.output_len <= 12 for r in requests)
    assert all(0 <= t < 256 for r in requests for t in r.prompt_ids)
    assert requests == datasets.random_requests(50, 32, 8, token_range=(0, 256), range_ratio=0.5, seed=3)
    info = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 511, "stop_token_ids": [257, 258]}
    assert datasets.ordinary_token_range(info) == (0, 256)


def test_long_prompts_are_token_exact_cuts_of_the_corpus():
    tok = ByteTokenizer()
    requests = datasets.long_requests(3, 5000, 4, tok.encode, seed=0)
    assert [r.prompt_len for r in requests] == [5000] * 3
    assert len({r.prompt_ids[:64] for r in requests}) == 3  # each starts at its own offset
    assert tok.decode(list(requests[0].prompt_ids)).isascii()


def test_bench_serve_end_to_end_emits_every_key(tmp_path):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--concurrency", "1,2", "--num-prompts", "3", "--prompt-tokens", "16", "--max-tokens", "4",
            "--request-rate", "50", "--burstiness", "0.5", "--goodput", "ttft:600000", "tpot:600000",
            "--save-detailed", "--json", str(out)]
    # its own process: the benchmark starts (and stops) a private Ray + Serve, whatever this session runs
    run = subprocess.run([sys.executable, "-m", "k3ray.cli", *argv], capture_output=True, text=True, timeout=540,
                         cwd=tmp_path)  # off the repository root: python -m puts the cwd first on sys.path
    assert run.returncode == 0, run.stderr[-3000:]
    assert "served_vs_engine_tok_s" in run.stdout
    result = json.loads(out.read_text())
    assert VLLM_KEYS <= set(result) and {"served_vs_engine_tok_s", "levels", "machine", "config"} <= set(result)
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert LEVEL_KEYS <= set(level) and level["completed"] == 3 and level["failed"] == 0
        assert level["engine_output_throughput"] > 0 and level["served_vs_engine_tok_s"] > 0
    assert result["served_vs_engine_tok_s"] == result["levels"][-1]["served_vs_engine_tok_s"]
    assert result["output_lens"] == [4, 4, 4] and result["input_lens"] == [16, 16, 16]
    assert result["total_output_tokens"] == 12 and result["errors"] == ["", "", ""]
    assert all(latency >= ttft > 0 for latency, ttft in zip(result["latencies"], result["ttfts"]))
    # random bytes often end mid-character: the server holds such text back, so a chunk may carry several tokens
    assert all(0 <= len(itl) <= 3 and min(itl, default=0) >= 0 for itl in result["itls"])
    assert result["max_concurrent_requests"] <= 2
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs nobody misses
    assert result["request_rate"] == 50 and result["burstiness"] == 0.5 and result["max_concurrency"] == 2
