"""`k3ray eval lm-eval --endpoint`: lm-eval's stock local-completions against the live Serve app
(tiny K3, loopback, offline) on the shipped tasks: a loglikelihood (multiple-choice) task, a
generate_until task, perplexity (loglikelihood_rolling) and the NIAH task. Every served score is
checked against the in-process `k3ray` lm-eval model on the same checkpoint (itself checked
against the plain model API in test_lm_eval_model.py)."""

import json

import httpx
import pytest

from k3ray.cli import main as k3ray_main
from k3ray.evals import lm_eval_bridge as bridge

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-lm-eval"
MAX_MODEL_LEN = 1024
TASKS = ("k3ray_mc", "k3ray_gen", "k3ray_ppl", "k3ray_niah")
LIMIT = 6
NIAH_LENGTH, NIAH_GEN_TOKENS = 512, 32
METADATA = {"max_seq_lengths": [NIAH_LENGTH], "depths": [50]}
LOGPROB_ATOL = 1e-3  # fp32 on both sides; batched / chunked prefill only reorders sums
# a rolling document sums ~4,000 fp32 token log-probs (total ~ -5e4); measured relative error ~1e-8
ROLLING_RTOL = 1e-6


@pytest.fixture(scope="module")
def server(serve_app, tiny_checkpoint):
    return serve_app({"model": {"model": tiny_checkpoint}, "server": {"served_model_name": MODEL},
                      "engine": {"max_model_len": MAX_MODEL_LEN, "cache_memory_mb": 16}})


def flag(value) -> bool:
    """is_greedy as lm-eval saves it: a bool, or its str() in the samples JSONL."""
    assert value in (True, False, "True", "False"), value
    return value in (True, "True")


def by_doc(samples: list[dict]) -> dict[int, dict]:
    return {s["doc_id"]: s for s in samples}


@pytest.fixture(scope="module")
def served(server, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm_eval_served")
    rc = k3ray_main(["eval", "lm-eval", "--endpoint", server, "--tasks", ",".join(TASKS), "--limit", str(LIMIT),
                     "--out", str(out), "--log-samples", "--concurrency", "2", "--metadata", json.dumps(METADATA)])
    (path,) = out.glob("*/results_*.json")
    samples = {}
    for task in TASKS:
        (file,) = out.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = by_doc([json.loads(line) for line in file.read_text().splitlines()])
    return rc, json.loads(path.read_text()), samples


@pytest.fixture(scope="module")
def local(tiny_checkpoint):
    results, path = bridge.run_lm_eval(TASKS, "k3ray", {"pretrained": tiny_checkpoint, "max_model_len": MAX_MODEL_LEN},
                                       limit=LIMIT, metadata=METADATA, log_samples=True)
    assert path is None
    return results, {task: by_doc(results["samples"][task]) for task in TASKS}


def test_the_probe_reads_the_servers_context_and_tokenizer(server):
    info = bridge.probe_server(server + "/v1")
    assert info == bridge.ServerInfo(server, MODEL, MAX_MODEL_LEN, True)
    args = bridge.local_completions_args(info, num_concurrent=3)
    assert args["base_url"] == f"{server}/v1/completions" and args["max_length"] == MAX_MODEL_LEN
    assert args["tokenizer_backend"] == "remote" and args["tokenized_requests"] is True
    assert args["timeout"] == bridge.DEFAULT_TIMEOUT_S and args["num_concurrent"] == 3
    with pytest.raises(ValueError, match="max_length must be in"):
        bridge.local_completions_args(info, max_length=4 * MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="unknown lm-eval task"):
        bridge.run_lm_eval(["no_such_task_k3ray"], "local-completions", args)


def test_the_cli_writes_lm_evals_results_json(served):
    rc, results, samples = served
    assert rc == 0
    assert set(results["results"]) == set(TASKS)
    assert results["config"]["model"] == "local-completions"
    assert results["config"]["model_args"]["max_length"] == MAX_MODEL_LEN
    # k3ray_ppl ships 2 documents; METADATA asks k3ray_niah for one length x one depth
    assert {task: len(samples[task]) for task in TASKS} == {"k3ray_mc": LIMIT, "k3ray_gen": LIMIT, "k3ray_ppl": 2,
                                                             "k3ray_niah": 1}


def test_the_loglikelihood_task_matches_the_in_process_model(served, local):
    _, results, samples = served
    local_results, local_samples = local
    for doc_id, sample in samples["k3ray_mc"].items():
        want = local_samples["k3ray_mc"][doc_id]["resps"]
        for (lp, greedy), (ref_lp, ref_greedy) in zip((r[0] for r in sample["resps"]), (r[0] for r in want)):
            assert float(lp) == pytest.approx(float(ref_lp), abs=LOGPROB_ATOL) and flag(greedy) == flag(ref_greedy)
    assert results["results"]["k3ray_mc"]["acc,none"] == local_results["results"]["k3ray_mc"]["acc,none"]


def test_the_generate_until_task_matches_the_in_process_model(served, local):
    _, results, samples = served
    local_results, local_samples = local
    for doc_id, sample in samples["k3ray_gen"].items():
        assert sample["resps"] == local_samples["k3ray_gen"][doc_id]["resps"]
    metric = "exact_match,none"
    assert results["results"]["k3ray_gen"][metric] == local_results["results"]["k3ray_gen"][metric]


def test_perplexity_matches_the_in_process_model(served, local):
    _, _, samples = served
    _, local_samples = local
    for doc_id, sample in samples["k3ray_ppl"].items():
        want = float(local_samples["k3ray_ppl"][doc_id]["resps"][0][0])
        assert float(sample["resps"][0][0]) == pytest.approx(want, rel=ROLLING_RTOL)


def test_niah_prompts_are_token_exact_for_the_served_tokenizer(served, local, server):
    _, results, samples = served
    _, local_samples = local
    (sample,) = samples["k3ray_niah"].values()
    prompt = sample["arguments"]["gen_args_0"]["arg_0"]  # the saved JSONL names the arguments
    count = httpx.post(f"{server}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=30).json()["count"]
    assert count == NIAH_LENGTH - NIAH_GEN_TOKENS
    assert sample["doc"]["length"] == NIAH_LENGTH and sample["doc"]["depth"] == 50
    (want,) = local_samples["k3ray_niah"].values()
    assert sample["resps"] == want["resps"]
    assert 0.0 <= results["results"]["k3ray_niah"]["string_match,none"] <= 1.0
