"""The in-process `k3ray` lm-eval model through lm-eval's own `simple_evaluate`, offline, on the
shipped task YAMLs. Every score is checked against the plain model API (`k3ray.api.K3`), which
shares no code with the engine the lm-eval model runs on."""

import json

import lm_eval
import pytest
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import k3ray.evals.lm_eval_model as lm_eval_model
from k3ray.api import K3
from k3ray.cli import main as k3ray_main
from k3ray.evals.lm_eval_bridge import TASKS_DIR

pytestmark = pytest.mark.timeout(600)
MAX_LENGTH = 512
LIMIT = 6
LOGPROB_ATOL = 1e-3  # fp32 on both sides; batched / chunked prefill only reorders sums
# a rolling document sums ~4,000 fp32 token log-probs (total ~ -5e4); measured relative error 2e-8
ROLLING_RTOL = 1e-6


@pytest.fixture(scope="module")
def results(tiny_checkpoint):
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    return lm_eval.simple_evaluate(
        model="k3ray", model_args=f"pretrained={tiny_checkpoint},max_model_len={MAX_LENGTH}",
        tasks=["k3ray_mc", "k3ray_gen", "k3ray_ppl"], limit=LIMIT, task_manager=manager, log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


@pytest.fixture(scope="module")
def k3(tiny_checkpoint):
    return K3.load(tiny_checkpoint)


def encode_pair(tok, context, continuation):
    """lm-eval's split: trailing context spaces go to the continuation; encode whole, then cut."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def test_the_model_is_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("k3ray") is lm_eval_model.K3RayLM
    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"  # lm-eval's own models still load


def test_multiple_choice_scores_are_the_models_loglikelihoods(results, k3):
    samples = results["samples"]["k3ray_mc"]
    assert len(samples) == LIMIT
    correct = 0
    for sample in samples:
        got = [resp[0] for resp in sample["resps"]]
        ref = [k3.loglikelihood(*encode_pair(k3.tokenizer, c, x)) for c, x in map(tuple, sample["arguments"])]
        for (lp, greedy), (ref_lp, ref_greedy) in zip(got, ref):
            assert float(lp) == pytest.approx(ref_lp, abs=LOGPROB_ATOL) and bool(greedy) == ref_greedy
        correct += max(range(len(ref)), key=lambda i: ref[i][0]) == sample["doc"]["label"]
    assert results["results"]["k3ray_mc"]["acc,none"] == pytest.approx(correct / LIMIT)


def test_generate_until_is_greedy_generation_cut_at_the_stops(results, k3):
    tok = k3.tokenizer
    for sample in results["samples"]["k3ray_gen"]:
        context, gen_kwargs = sample["arguments"][0]
        ids = k3.generate(tok.encode(context), max_new_tokens=gen_kwargs["max_gen_toks"],
                          stop_token_ids=sorted(tok.stop_token_ids))
        want = tok.decode(ids, skip_special_tokens=True)
        for stop in gen_kwargs["until"]:
            want = want.split(stop)[0]
        assert sample["resps"][0][0] == want


def test_rolling_loglikelihood_sums_lm_evals_windows(results, k3):
    tok = k3.tokenizer
    samples = results["samples"]["k3ray_ppl"]
    assert len(samples) == 2
    for sample in samples:
        text = sample["arguments"][0][0]
        windows = map(make_disjoint_window, get_rolling_token_windows(
            tok.encode(text), prefix_token=tok.bos_token_id, max_seq_len=MAX_LENGTH - 2, context_len=1))
        want = sum(k3.loglikelihood(context, continuation)[0] for context, continuation in windows)
        assert float(sample["resps"][0][0]) == pytest.approx(want, rel=ROLLING_RTOL)
    assert results["results"]["k3ray_ppl"]["word_perplexity,none"] > 1


def test_bad_arguments_are_refused(tiny_checkpoint, results):
    with pytest.raises(ValueError, match="max_length"):
        lm_eval_model.K3RayLM(pretrained=tiny_checkpoint, max_model_len=256, max_length=1024)
    with pytest.raises(ValueError, match="dtype"):
        lm_eval_model.K3RayLM(pretrained=tiny_checkpoint, dtype="float8")
    lm = lm_eval_model.K3RayLM(pretrained=tiny_checkpoint, max_model_len=256)
    with pytest.raises(ValueError, match="num_beams"):
        lm._sampling_params({"until": ["\n"], "num_beams": 4})
    penalised = lm._sampling_params({"until": ["\n"], "do_sample": True, "repetition_penalty": 1.2,
                                     "presence_penalty": 0.5, "frequency_penalty": 0.25})
    assert (penalised.repetition_penalty, penalised.presence_penalty, penalised.frequency_penalty) == (1.2, 0.5, 0.25)
    assert lm_eval_model.K3RayLM(pretrained=lm.llm).max_length == 256  # an LLM is reused as it is
    with pytest.raises(ValueError, match="only apply when pretrained is a path"):
        lm_eval_model.K3RayLM(pretrained=lm.llm, max_num_seqs=4)


def test_the_cli_runs_a_checkpoint_in_process(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "lm_eval"
    assert k3ray_main(["eval", "lm-eval", "--model", tiny_checkpoint, "--tasks", "k3ray_mc", "--limit", "2",
                       "--max-model-len", "256", "--out", str(out)]) == 0
    (path,) = out.glob("*/results_*.json")
    saved = json.loads(path.read_text())
    assert "acc,none" in saved["results"]["k3ray_mc"] and saved["config"]["model"] == "k3ray"
    assert str(path) in capsys.readouterr().out
