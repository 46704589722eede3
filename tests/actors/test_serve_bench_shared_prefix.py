"""`k3ray bench serve --workload shared-prefix` (actors/bench/serve/shared_prefix.py): its
conversations, run order, summary and flags; one repeat of a small workload on the module's Serve
app (three deployments: affinity, default, one replica), whose replicas' own counters must show
what affinity routing saves; the whole command with repeats is `slow`."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

from k3ray.cli import build_parser
from k3ray.actors.bench.serve import shared_prefix
from k3ray.actors.bench.serve.shared_prefix import conversations


def bench_args(*flags: str):
    args = build_parser(["bench", "serve"]).parse_args(["bench", "serve", "--workload", "shared-prefix", *flags])
    shared_prefix.check_arguments(args)
    return args


def test_a_groups_conversations_share_its_prefix_and_each_turn_extends_the_one_before():
    convs = conversations(5, 3, prefix_len=32, turn_len=10, output_len=2, token_range=(5, 300), seed=1, groups=2)
    assert [len(c) for c in convs] == [3] * 5
    for turns in convs:
        assert [r.prompt_len for r in turns] == [42, 54, 66] and all(r.output_len == 2 for r in turns)
        for before, after in zip(turns, turns[1:]):
            assert after.prompt_ids[: before.prompt_len] == before.prompt_ids
        assert all(5 <= t < 300 for t in turns[-1].prompt_ids)
    groups = shared_prefix.group_of(5, 2, seed=1)
    assert groups[:2] == [0, 1] and sorted(groups) == [0, 0, 0, 1, 1]  # two openers, then equal shares
    firsts = [c[0].prompt_ids for c in convs]
    for c in range(5):
        assert firsts[c][:32] == firsts[groups[c]][:32]
    assert firsts[0][:16] != firsts[1][:16]  # the groups share nothing
    assert len({f[32:] for f in firsts}) == 5  # each conversation's own opening
    assert conversations(5, 3, 32, 10, 2, (5, 300), seed=1, groups=2) == convs
    assert conversations(5, 3, 32, 10, 2, (5, 300), seed=2, groups=2) != convs


def test_the_routers_alternate_which_runs_first_and_one_replica_runs_once():
    assert shared_prefix.schedule(3) == [(0, "affinity"), (0, "default"), (0, "single_replica"),
                                         (1, "default"), (1, "affinity"), (2, "affinity"), (2, "default")]


def test_the_summary_is_the_median_ratio_its_spread_and_the_hit_rates_over_every_run():
    def row(ttft, prefill, cached, looked_up):
        return {"mean_ttft_ms": ttft, "prefill_tokens_per_replica": prefill, "prefill_tokens": sum(prefill),
                "cached_tokens": cached, "looked_up_tokens": looked_up}

    runs = {"affinity": [row(50.0, [60, 40], 90, 100), row(80.0, [100, 0], 60, 100), row(30.0, [70, 30], 90, 100)],
            "default": [row(100.0, [100, 100], 50, 100), row(100.0, [120, 80], 50, 100), row(100.0, [100, 100], 60, 100)],
            "single_replica": [row(60.0, [100], 80, 100)]}
    summary = shared_prefix.summarize(runs)
    assert summary["affinity_ttft_ratio"] == pytest.approx(0.5)
    assert summary["affinity_ttft_ratio_spread"] == pytest.approx([0.3, 0.8])
    assert summary["affinity_prefill_ratio"] == pytest.approx(0.5)
    assert summary["affinity_hit_rate"] == pytest.approx(0.8) and summary["default_hit_rate"] == pytest.approx(160 / 300)
    assert summary["single_replica_hit_rate"] == pytest.approx(0.8) and summary["affinity_vs_single_hit_rate"] == 1
    assert summary["prefill_tokens_per_replica"]["default"] == [[100, 100], [120, 80], [100, 100]]


def test_the_workload_flags_and_their_checks():
    args = bench_args("--conversations", "4", "--prefix-groups", "3", "--turns", "3", "--turn-len", "32",
                      "--start-gap-s", "0", "--repeats", "2")
    assert (args.workload, args.conversations, args.prefix_groups, args.turns, args.turn_len, args.start_gap_s,
            args.repeats, args.input_len, args.output_len) == ("shared-prefix", 4, 3, 3, 32, 0.0, 2, 4096, 4)
    assert (bench_args().prefix_groups, bench_args().conversations, bench_args().repeats) == (4, 16, 3)
    for flags, named in ((["--prefix-groups", "5", "--conversations", "4"], "--prefix-groups"),
                         (["--prefix-groups", "0"], "--prefix-groups"), (["--repeats", "0"], "--repeats"),
                         (["--start-gap-s", "-1"], "--start-gap-s"), (["--endpoint", "http://x"], "--endpoint")):
        with pytest.raises(ValueError, match=named):
            bench_args(*flags)


SMALL = ("--prompt-tokens", "1024", "--prefix-groups", "2", "--conversations", "8", "--turns", "3",
         "--start-gap-s", "0.1", "--repeats", "1")


@pytest.fixture(scope="module")
def one_repeat(serve_app, tiny_checkpoint):
    """The benchmark's result for SMALL on the module's Serve app, and the URL of the last app."""
    from k3ray.actors.serve.isolation import free_port

    port, urls = free_port(), []

    def deploy(app_args: dict) -> str:
        urls.append(serve_app(app_args, port=port))
        return urls[-1]

    args = bench_args("--model", tiny_checkpoint, *SMALL)
    return args, shared_prefix.compare(args, deploy), urls[-1]


def test_each_replica_reports_the_prefill_it_computed_and_affinity_computes_less(one_repeat):
    args, result, _ = one_repeat
    per_replica = result["prefill_tokens_per_replica"]
    assert {name: [len(r) for r in runs] for name, runs in per_replica.items()} == \
        {"affinity": [2], "default": [2], "single_replica": [1]}
    prompts = conversations(8, 3, 1024, 64, 4, (0, 1), 0, groups=2)  # lengths only
    every_prompt = sum(r.prompt_len for c in prompts for r in c)
    distinct = 2 * 1024 + 8 * 64 + 8 * 2 * (4 + 64)  # the prompts' prefix tree: each token computed somewhere
    totals = {}
    for name, (counts,) in per_replica.items():
        assert counts == sorted(counts, reverse=True) and all(isinstance(n, int) for n in counts)
        totals[name] = sum(counts)
        assert distinct <= totals[name] <= every_prompt, (name, counts)
        (run,) = result["runs"][name]
        assert run["completed"] == 24 and run["failed"] == 0 and run["prefill_tokens"] == totals[name]
        # a prefix-cache hit is the only prompt token not computed
        assert run["looked_up_tokens"] - run["cached_tokens"] == totals[name]
    # the default router sends a group's conversations to both replicas, each computing the prefix;
    # affinity keeps each group (one per replica: within its imbalance bound) where it opened
    assert totals["affinity"] < totals["default"]
    assert result["affinity_prefill_ratio"] == pytest.approx(totals["affinity"] / totals["default"])
    assert result["affinity_hit_rate"] > result["default_hit_rate"]


def test_the_ttft_ratio_and_its_spread_over_one_repeat(one_repeat):
    _, result, _ = one_repeat
    ratio = result["affinity_ttft_ratio"]
    assert ratio > 0 and result["affinity_ttft_ratio_spread"] == [ratio, ratio]
    assert ratio == pytest.approx(result["runs"]["affinity"][0]["mean_ttft_ms"] /
                                  result["runs"]["default"][0]["mean_ttft_ms"])
    for key in ("affinity_hit_rate", "default_hit_rate", "single_replica_hit_rate"):
        assert 0 < result[key] < 1
    assert result["workload"]["repeats"] == 1 and len(result["load_average"]["before"]) == 3


def test_the_other_conversations_start_once_the_openers_had_their_first_turn(one_repeat):
    _, _, url = one_repeat
    from k3ray.actors.bench.serve.datasets import ordinary_token_range
    from k3ray.actors.bench.serve.server import server_facts

    model, info = server_facts(url, None)
    convs = conversations(4, 2, 64, 16, 2, ordinary_token_range(info), seed=7, groups=2)
    results = asyncio.run(shared_prefix.run_conversations(url, model, convs, 120, None, 0.0, openers=2))
    assert all(r.success for r in results)
    openers_done = max(r.start_time + r.latency for r in results[0:4:2])  # the openers' first turns
    assert min(r.start_time for r in results[4:8:2]) >= openers_done  # the other two's first turns


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_whole_command_with_repeats(tmp_path, serve_ray):
    """`k3ray bench serve --workload shared-prefix --repeats 2` on its own Ray: the keys, per repeat."""
    out = tmp_path / "shared-prefix.json"
    # not the module's Serve Ray's variables (serve_app sets them here): its HAProxy holds those ports
    env = {name: value for name, value in os.environ.items() if name not in serve_ray.environment}
    done = subprocess.run([sys.executable, "-m", "k3ray.cli", "bench", "serve", "--workload", "shared-prefix",
                           *SMALL[:-1], "2", "--json", str(out)], cwd=tmp_path, env=env, timeout=850,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    low, high = result["affinity_ttft_ratio_spread"]
    assert low <= result["affinity_ttft_ratio"] <= high and len(result["affinity_ttft_ratios"]) == 2
    assert [len(runs) for runs in result["prefill_tokens_per_replica"].values()] == [2, 2, 1]
    assert result["affinity_prefill_ratio"] < 1 and result["machine"]["cores"]
