"""lm-eval's stock `local-completions` model against the live Serve app, offline: the remote
tokenizer routes, token-id prompts, echo + logprobs for a loglikelihood (multiple-choice) task and
plain generation for a generate_until task, both from JSONL files written here. Every score is
checked against the tiny K3 run directly."""

import json
import textwrap

import pytest

from k3ray.api import K3

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-eval"
LOGPROB_ATOL = 1e-3  # fp32 on both sides; batched / chunked prefill only reorders sums
MC_DOCS = [
    {"question": "Ray is a", "choices": [" framework", " fish", " colour"], "label": 0},
    {"question": "The sky is", "choices": [" blue", " loud"], "label": 0},
    {"question": "2 + 2 =", "choices": [" 4", " 5", " 22"], "label": 0},
    {"question": "Kimi speaks", "choices": [" Chinese", " English"], "label": 1},
]
GEN_DOCS = [{"prompt": "Q: name a colour.\nA:", "answer": " red"}, {"prompt": "Hello,", "answer": " world"},
            {"prompt": "1, 2, 3,", "answer": " 4"}]
MAX_GEN_TOKS = 8



@pytest.fixture(scope="module")
def server(serve_app, k2_tiny_checkpoint):  # K2's format ships a Jinja template for lm-eval's tokenizer
    return serve_app(
        {"model": {"model": k2_tiny_checkpoint}, "server": {"served_model_name": MODEL},
         "engine": {"max_model_len": 1024, "cache_memory_mb": 16}}
    )


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (root / "k3ray_mc.yaml").write_text(textwrap.dedent(f"""\
        task: k3ray_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{label}}}}"
        target_delimiter: ""
        metric_list:
          - metric: acc
        """))
    (root / "k3ray_gen.yaml").write_text(textwrap.dedent(f"""\
        task: k3ray_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {root / "gen.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{prompt}}}}"
        doc_to_target: "{{{{answer}}}}"
        target_delimiter: ""
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: {MAX_GEN_TOKS}
          do_sample: false
        metric_list:
          - metric: exact_match
        """))
    return root


def evaluate(server, tasks_dir, model: str, route: str, model_args: str, tasks: list[str], **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = f"model={MODEL},base_url={server}{route},max_retries=1,timeout=120,{model_args}"
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks,
                           task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, **kwargs)


COMPLETIONS = "tokenized_requests=True,num_concurrent=2,batch_size=2,max_length=1024"


@pytest.fixture(scope="module")
def results(server, tasks_dir):
    return evaluate(server, tasks_dir, "local-completions", "/v1/completions",
                    f"tokenizer_backend=remote,{COMPLETIONS}", ["k3ray_mc", "k3ray_gen"])


@pytest.fixture(scope="module")
def k3(k2_tiny_checkpoint):
    return K3.load(k2_tiny_checkpoint)


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing context spaces go to the continuation; encode whole, then cut."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def test_loglikelihood_task_scores_match_the_model(results, k3):
    samples = results["samples"]["k3ray_mc"]
    assert len(samples) == len(MC_DOCS)
    correct = 0
    for sample in samples:
        pairs = [tuple(a) for a in sample["arguments"]]
        got = [resp[0] for resp in sample["resps"]]
        ref = [k3.loglikelihood(*encode_pair(k3.tokenizer, c, x)) for c, x in pairs]
        for (lp, greedy), (ref_lp, ref_greedy) in zip(got, ref):
            assert float(lp) == pytest.approx(ref_lp, abs=LOGPROB_ATOL) and bool(greedy) == ref_greedy
        correct += max(range(len(ref)), key=lambda i: ref[i][0]) == sample["doc"]["label"]
    assert results["results"]["k3ray_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS))


def test_generate_until_task_matches_greedy_generation(results, k3):
    tok = k3.tokenizer
    samples = results["samples"]["k3ray_gen"]
    assert len(samples) == len(GEN_DOCS)
    matches = 0
    for sample in samples:
        context = sample["arguments"][0][0]
        ids = k3.generate(tok.encode(context), max_new_tokens=MAX_GEN_TOKS, stop_token_ids=sorted(tok.stop_token_ids))
        want = tok.decode(ids, skip_special_tokens=True).split("\n")[0].split("[EOS]")[0]
        assert sample["resps"][0][0] == want
        matches += want == sample["doc"]["answer"]
    assert results["results"]["k3ray_gen"]["exact_match,none"] == pytest.approx(matches / len(GEN_DOCS))


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda sample: sample["doc_id"])]


def test_a_hugging_face_tokenizer_on_the_client_gives_the_same_scores(server, tasks_dir, k2_tiny_checkpoint, results):
    """`tokenizer_backend=huggingface`: AutoTokenizer loads the checkpoint's tokenizer.json and tokenizes
    the requests on the client, as vLLM's clients do; every request and score is the remote one's."""
    hf = evaluate(server, tasks_dir, "local-completions", "/v1/completions",
                  f"tokenizer_backend=huggingface,tokenizer={k2_tiny_checkpoint},{COMPLETIONS}", ["k3ray_mc", "k3ray_gen"])
    for ours, remote in zip(responses(hf, "k3ray_mc"), responses(results, "k3ray_mc"), strict=True):
        assert [bool(r[0][1]) for r in ours] == [bool(r[0][1]) for r in remote]  # the same requests, batched
        assert [float(r[0][0]) for r in ours] == pytest.approx([float(r[0][0]) for r in remote], abs=LOGPROB_ATOL)
    assert responses(hf, "k3ray_gen") == responses(results, "k3ray_gen")
    for task, metric in (("k3ray_mc", "acc,none"), ("k3ray_gen", "exact_match,none")):
        assert hf["results"][task][metric] == results["results"][task][metric]


def test_chat_completions_equal_completions_of_the_hugging_face_chat_template(server, tasks_dir, k2_tiny_checkpoint):
    """`local-chat-completions` (the server renders the chat) and `local-completions` with the prompt
    rendered on the client by the tokenizer's chat template give the same greedy answers."""
    chat = evaluate(server, tasks_dir, "local-chat-completions", "/v1/chat/completions", "num_concurrent=2",
                    ["k3ray_gen"], apply_chat_template=True)
    client_rendered = evaluate(server, tasks_dir, "local-completions", "/v1/completions",
                               f"tokenizer_backend=huggingface,tokenizer={k2_tiny_checkpoint},{COMPLETIONS}",
                               ["k3ray_gen"], apply_chat_template=True)
    assert len(responses(chat, "k3ray_gen")) == len(GEN_DOCS)
    assert responses(chat, "k3ray_gen") == responses(client_rendered, "k3ray_gen")
    metric = "exact_match,none"
    assert chat["results"]["k3ray_gen"][metric] == client_rendered["results"]["k3ray_gen"][metric]
