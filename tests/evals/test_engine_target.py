"""EngineTarget: the eval `Target` over an in-process engine (no server, no Ray). Greedy answers
are checked against the plain K3 model API (`k3ray.api.K3`), which shares no code with the engine."""

import json
import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest

from k3ray.api import K3
from k3ray.engine import LLM
from k3ray.evals.engine_target import EngineTarget
from k3ray.evals.runner import RunConfig, run_eval
from k3ray.evals.target import Target

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 6
PROMPTS = ["Hello, world", "The cat sat on the", "1, 2, 3,", "Q: why?\nA:", "<|im_end|> special", "x"]


@pytest.fixture(scope="module")
def llm(k2_tiny_checkpoint):
    return LLM(k2_tiny_checkpoint, max_model_len=1024, cache_memory_bytes=16 * 1024**2)


@pytest.fixture(scope="module")
def target(llm):
    return EngineTarget(llm)


@pytest.fixture(scope="module")
def k3(k2_tiny_checkpoint):
    return K3.load(k2_tiny_checkpoint)


def greedy_text(k3, ids, max_tokens):
    tok = k3.tokenizer
    out = k3.generate(ids, max_new_tokens=max_tokens, stop_token_ids=sorted(tok.stop_token_ids))
    return tok.decode(out, skip_special_tokens=True)


def test_it_is_a_target_that_counts_what_the_server_counts(target, llm):
    assert isinstance(target, Target)
    tok = llm.tokenizer
    ids = target.tokenize("a<|im_end|>b")
    # the server's /tokenize and /v1/completions parse special-token strings into their ids
    assert ids == [ord("a"), tok.special_tokens["<|im_end|>"], ord("b")]
    assert ids == tok.encode("a<|im_end|>b", allow_special=True)
    assert target.detokenize(target.tokenize("Hello, world")) == "Hello, world"
    assert target.max_context == 1024 and target.name.startswith("engine:")


def test_complete_is_the_models_greedy_continuation(target, k3):
    for prompt in PROMPTS:
        assert target.complete(prompt, MAX_TOKENS) == greedy_text(k3, target.tokenize(prompt), MAX_TOKENS)


def test_threads_share_one_engine_and_get_their_own_answers(target):
    alone = [target.complete(p, MAX_TOKENS) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: target.complete(p, MAX_TOKENS), PROMPTS))
    assert together == alone
    assert not target.engine.has_unfinished_requests()


def test_a_failed_step_fails_every_request_in_it_and_the_target_goes_on(target, monkeypatch):
    alone = target.complete(PROMPTS[0], MAX_TOKENS)
    executor = target.engine.executor
    execute, failures = executor.execute, [RuntimeError("device lost")]

    def execute_failing_once(plan):
        if failures:
            raise failures.pop()
        return execute(plan)

    monkeypatch.setattr(executor, "execute", execute_failing_once)
    target.engine.add_request("another-caller", target.tokenize(PROMPTS[1]))  # batched with the call below
    with pytest.raises(RuntimeError, match="device lost"):
        target.complete(PROMPTS[0], MAX_TOKENS)
    assert not target.engine.has_unfinished_requests()
    assert target.complete(PROMPTS[0], MAX_TOKENS) == alone


def test_chat_prompts_use_the_chat_template(target, llm, k3):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = llm.tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, messages[1]],
                                         add_generation_prompt=True, continue_final_message=False)
    assert target.prompt_ids(messages) == expected
    assert target.complete(messages, MAX_TOKENS) == greedy_text(k3, expected, MAX_TOKENS)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        target.complete(image, MAX_TOKENS)


def test_prompts_past_the_context_are_refused(target, llm):
    with pytest.raises(ValueError, match="max_context=1024"):
        target.complete("x" * 1020, MAX_TOKENS)
    with pytest.raises(ValueError, match="max_context"):
        EngineTarget(llm, max_context=4096)
    with pytest.raises(ValueError, match="LLM or an LLMEngine"):
        EngineTarget("http://127.0.0.1:8000")


def test_it_cannot_be_shipped_to_another_process(target):
    with pytest.raises(TypeError, match="executor='threads'"):
        pickle.dumps(target)


def test_a_niah_grid_runs_through_the_runner(target, tmp_path):
    config = RunConfig(tasks=("niah",), lengths=(512,), depths=(0.0, 100.0), concurrency=2, executor="threads")
    summary = run_eval(config, target, tmp_path, progress=False)
    assert summary["n"] == 2 and summary["errors"] == 0
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["prompt_tokens"] for r in records) == [512, 512]
    for r in records:
        assert r["score"] in (0.0, 1.0)


def test_the_eval_command_runs_its_engine_in_the_asked_dtype(k2_tiny_checkpoint, tmp_path):
    """`k3ray eval --model DIR --dtype bfloat16`: the engine's weights and caches are bf16."""
    import torch

    from k3ray.cli import build_parser
    from k3ray.evals.cli import _engine_target

    argv = ["eval", "niah", "--model", k2_tiny_checkpoint, "--out", str(tmp_path), "--device", "cpu",
            "--dtype", "bfloat16", "--threads", str(torch.get_num_threads()), "--max-model-len", "256",
            "--cache-memory-mb", "16"]
    bf16 = _engine_target(build_parser(argv).parse_args(argv))
    assert bf16.complete("The cat sat on the", 3) is not None
    executor = bf16.engine.executor
    assert executor.model.dtype == torch.bfloat16
    assert {t.dtype for t in executor.cache.mla_latent.values()} == {torch.bfloat16}


def test_image_and_video_chats_go_to_the_vision_tower_as_llm_chat_sends_them(target, llm):
    """The tiny checkpoint's tower (random weights): EngineTarget answers a card among images, and the
    frames of a video as image parts and as a GIF, exactly as LLM.chat (the engine's own media path),
    and counts what /tokenize counts (each image its merged tokens)."""
    import random

    from k3ray.evals.tasks import images, multimodal
    from k3ray.sampling_params import SamplingParams

    rng = random.Random(0)
    pictures = [images.scene(rng) for _ in range(3)]
    pictures[2] = images.with_card(pictures[2], "123456")
    frames = images.moving_frames(rng, 5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for messages in (multimodal.image_messages(pictures), multimodal.video_messages(frames, "frames"),
                     multimodal.video_messages(frames, "gif")):
        want = llm.chat(messages, params)[0]
        assert target.complete(messages, MAX_TOKENS) == want.outputs[0].text
        assert target.count_chat_tokens(messages) == len(want.prompt_token_ids)
    ids, media = target.prompt_inputs(multimodal.image_messages(pictures))
    assert len(media) == 3 and target.count_chat_tokens(multimodal.image_messages(pictures)) == \
        len(ids) + sum(m.num_tokens - 1 for m in media)


def test_media_on_a_text_model_and_audio_are_refused_by_name(target):
    from k3ray.evals.tasks import images, multimodal

    text_only = EngineTarget(LLM("k3-tiny-niah", max_model_len=1024))
    messages = multimodal.image_messages([images.scene(__import__("random").Random(0))])
    with pytest.raises(ValueError, match="has no vision tower"):
        text_only.complete(messages, 4)
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    with pytest.raises(ValueError, match="input_audio part: k3ray's models take no audio"):
        target.complete(audio, 4)
