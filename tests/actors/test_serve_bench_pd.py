"""`k3ray bench serve --workload pd` (actors/bench/serve/pd.py): the window's gaps, the output
comparison, the handoff formula, and a whole run at small sizes (2.6K-token long prompts, two streams)
on real Serve apps on loopback — colocated, then disaggregated, each pinned core by core."""

import pytest

from k3ray.cli import build_parser
from k3ray.config import k3_tiny_config
from k3ray.actors.bench.serve import pd
from k3ray.actors.bench.serve.client import RequestResult

KEYS = ("pd_itl_p99_ratio", "pd_outputs_identical", "handoff_bytes_per_token_ratio", "handoff_ms_per_1k_tokens")


def parse(*argv: str):
    args = build_parser(["bench", "serve"]).parse_args(["bench", "serve", "--workload", "pd", *argv])
    pd.check(args)
    return args


def stream(start: float, ttft: float, itl: list[float], text: str = "ab", stopped: bool = True) -> RequestResult:
    return RequestResult(prompt_len=4, success=True, output_tokens=len(itl) + 1, ttft=ttft, itl=itl, start_time=start,
                         generated_text=text, stopped=stopped)


def test_only_the_gaps_ending_inside_the_window_count():
    # chunks at 1.0, 1.5, 3.0, 3.2, 9.0 (client seconds): the window [2, 4] holds the gaps 1.5 and 0.2
    result = stream(0.0, 1.0, [0.5, 1.5, 0.2, 5.8])
    assert [round(t, 6) for t, _ in pd.chunk_gaps(result)] == [1.5, 3.0, 3.2, 9.0]
    summary = pd.summarize("colocated", {"streams": [result], "longs": [], "window": (2.0, 4.0)})
    assert summary["window_gaps"] == 2 and summary["streams"][0]["window_gaps"] == 2
    assert summary["itl_max_ms"] == pytest.approx(1500) and summary["quiet_itl_p99_ms"] == pytest.approx(500)
    assert summary["streams_cover_window"] and summary["failed"] == []
    ran_out = pd.summarize("colocated", {"streams": [stream(0.0, 1.0, [0.5], stopped=False)], "longs": [],
                                         "window": (2.0, 4.0)})
    assert not ran_out["streams_cover_window"] and ran_out["itl_p99_ms"] is None


def test_streams_compare_by_prefix_and_long_prompts_whole():
    def app(stream_texts, long_texts):
        return {"streams": [stream(0, 0, [], t) for t in stream_texts],
                "longs": [stream(0, 0, [], t, stopped=False) for t in long_texts]}

    same, detail = pd.outputs_identical(app(["abc", "xy"], ["L1"]), app(["abcdef", "x"], ["L1"]))
    assert same and detail["stream_chars_compared"] == [3, 1]
    assert not pd.outputs_identical(app(["abc"], ["L1"]), app(["abd"], ["L1"]))[0]
    assert not pd.outputs_identical(app(["abc"], ["L1"]), app(["abc"], ["L2"]))[0]
    assert not pd.outputs_identical(app([""], ["L1"]), app(["abc"], ["L1"]))[0]  # nothing compared


def test_the_formula_is_latent_rows_plus_one_state_slot_per_handoff():
    config = k3_tiny_config()  # the default checkpoint's: 3 MLA layers of 16 + 8 latents, 6 KDA layers
    per_token = len(config.mla_layer_ids) * config.mla_latent_dim * 4
    heads, dim, width = config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
    slot = len(config.kda_layer_ids) * (heads * dim * dim * 4 + 3 * heads * dim * (width - 1) * 4)
    assert pd.handoff_formula_bytes(None, "float32", 1000, 2) == 1000 * per_token + 2 * slot
    assert pd.handoff_formula_bytes(None, "bfloat16", 10, 1) < pd.handoff_formula_bytes(None, "float32", 10, 1)


def test_the_flags_and_their_defaults():
    args = parse()
    assert (args.decode_streams, args.long_prompts, args.long_prompt_tokens, args.pin_cores) == (4, 2, 32768, False)
    assert (args.input_len, args.output_len) == (pd.STREAM_PROMPT, pd.STREAM_TOKENS)
    colocated, disaggregated = pd.serve_args(args, "colocated"), pd.serve_args(args, "disaggregated")
    assert colocated["autoscaling"]["max_replicas"] == 2 and "disaggregation" not in colocated
    assert disaggregated["autoscaling"]["max_replicas"] + disaggregated["disaggregation"]["prefill_replicas"] == 2
    assert colocated["engine"]["max_model_len"] >= 32768 + pd.LONG_OUTPUT  # the long prompts fit
    with pytest.raises(ValueError, match="--long-prompts"):
        parse("--long-prompts", "0")
    with pytest.raises(ValueError, match="--endpoint"):
        parse("--endpoint", "http://127.0.0.1:1")


@pytest.mark.timeout(600)
def test_a_small_run_reports_the_keys_with_equal_outputs(serve_app):
    """Both apps on the module's Serve: greedy outputs equal, every handoff byte accounted for."""
    from k3ray.actors.serve import launch as serve_launch
    from k3ray.actors.serve.isolation import free_port

    # long prompts of 2,600 tokens: several prefill chunks each (2,048-token steps ending at snapshots)
    args = parse("--long-prompt-tokens", "2600", "--decode-streams", "2", "--max-tokens", "4000", "--pin-cores")
    port = free_port()  # both apps behind the one HTTP port Serve started with
    result = pd.compare(args, lambda app_args: serve_app(app_args, name=pd.APP, port=port),
                        lambda: serve_launch.delete_app(pd.APP))
    assert all(result[key] is not None for key in KEYS), {key: result[key] for key in KEYS}
    assert result["pd_outputs_identical"] is True, result["outputs"]
    assert result["handoff_bytes_per_token_ratio"] == pytest.approx(1.0, rel=0.05)
    colocated, disaggregated = result["runs"]["colocated"], result["runs"]["disaggregated"]
    handoff = disaggregated["handoff"]
    assert handoff["handoffs"] == 2 and handoff["tokens_sent"] == handoff["prompt_tokens"] == 5200
    assert handoff["transports"] == {"host": handoff["handoffs"]} and handoff["transfer_s"] > 0
    # all but the last chunk's rows of each long prompt crossed while the later chunks ran
    assert handoff["parts"] >= 2 and 0.5 < result["handoff_latent_share_sent_during_prefill"] < 1
    for run in (colocated, disaggregated):
        assert run["failed"] == [] and run["window_gaps"] > 0 and run["streams_cover_window"]
    assert set(colocated["pinned_cores"]) == {"K3Server#0", "K3Server#1"}
    assert set(disaggregated["pinned_cores"]) == {"K3Prefill#0", "K3Server#0"}
    assert "handoff" not in colocated
