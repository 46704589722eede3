"""Image and video prompts through the engine: the output equals a manual reference (tower ->
splice -> whole-prompt forward -> greedy decode, no engine), chunked prefill over a media span
equals whole prefill, the prefix cache is keyed on media content, and preemption, speculative
verification and the vLLM-style / chat entry points keep working with media."""

import base64
import io

import pytest
import torch
from PIL import Image

from k3ray.config import preset
from k3ray.engine import LLM, EngineConfig, LLMEngine, LocalExecutor, SamplingParams, SpeculativeConfig
from k3ray.engine.media.inputs import MediaInputError
from k3ray.engine.media.prompt_media import local_vision_encoder
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.init import build_model
from k3ray.tokenizer import ByteTokenizer
from k3ray.vision import MediaConfig, encode_media, expand_placeholders, preprocess_media, splice_media_embeddings
from k3ray.vision.model import build_vision_model

CONFIG = preset("k3-tiny")
PLACEHOLDER = CONFIG.media_placeholder_token_id
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
BS = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: intra-op threads only add synchronisation (and stall on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIG, seed=0)


@pytest.fixture(scope="module")
def vision():
    return build_vision_model(CONFIG.vision, seed=0)


def picture(seed: int, size=(140, 112)) -> Image.Image:
    """Random pixels: 10 x 8 patches -> 5 x 4 = 20 placeholder tokens, spanning several blocks."""
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def data_url(img: Image.Image, fmt: str = "PNG", **save) -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def chat(img: Image.Image, question: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                         {"type": "image_url", "image_url": {"url": data_url(img)}},
                                         {"type": "text", "text": question}]}]


def make_llm(model, vision, **kw):
    options = dict(num_blocks=64, block_size=BS, enable_prefix_caching=False) | kw
    return LLM(model, ByteTokenizer(512), vision=vision, **options)


@torch.no_grad()
def reference(model, vision, prompt_ids: list[int], images: list[Image.Image], steps: int):
    """Greedy tokens and per-step log-softmax rows, with no engine: one whole-prompt forward over
    the spliced embeddings, then one token at a time."""
    media_cfg = MediaConfig.for_vision(CONFIG.vision)
    items = [preprocess_media("image", img, media_cfg) for img in images]
    expanded = expand_placeholders(prompt_ids, PLACEHOLDER, [m.num_tokens for m in items])
    media = encode_media(vision, torch.cat([m.pixel_values for m in items]), torch.cat([m.grid_thws for m in items]))
    ids = torch.tensor(expanded.token_ids)
    total = ids.numel() + steps
    cache = ModelCache.allocate(CONFIG, 1, -(-total // BS), BS)
    table = torch.arange(-(-total // BS))[None]

    def forward(fed: torch.Tensor, start: int, embeds=None) -> torch.Tensor:
        n = fed.numel()
        batch = ForwardBatch(torch.tensor([0, n]), torch.tensor([start + n]), torch.tensor([0]), table, cache)
        return model(fed, batch, torch.tensor([n - 1]), embeds)[-1].float()

    logits = forward(ids, 0, splice_media_embeddings(model.embed(ids), expanded.positions, media))
    tokens, rows = [], []
    for step in range(steps):
        rows.append(torch.log_softmax(logits, -1))
        tokens.append(int(logits.argmax()))
        logits = forward(torch.tensor([tokens[-1]]), ids.numel() + step)
    return expanded.token_ids, tokens, rows


def test_an_image_prompt_equals_the_manual_reference(model, vision):
    imgs = [picture(0), picture(1, size=(90, 60))]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(imgs[0])}},
                                             {"type": "text", "text": "and"},
                                             {"type": "image_url", "image_url": {"url": data_url(imgs[1])}},
                                             {"type": "text", "text": "Which differ?"}]}]
    tok = ByteTokenizer(512)
    prompt_ids, tokens, rows = reference(model, vision, tok.encode_chat(messages), imgs, GREEDY.max_tokens)
    out = make_llm(model, vision).chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == tokens
    for entry, row, t in zip(out.outputs[0].logprobs, rows, tokens):
        # fp32 on both sides; the engine's paged decode only reorders sums
        assert entry[t].logprob == pytest.approx(float(row[t]), abs=1e-4)


@pytest.mark.parametrize("chunk", [3, 13])
def test_chunked_prefill_over_a_media_span_equals_whole_prefill(model, vision, chunk):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    messages = chat(picture(2))
    whole = make_llm(model, vision).chat(messages, params)[0]
    chunked = make_llm(model, vision, max_num_batched_tokens=chunk).chat(messages, params)[0]
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids
    ids = whole.prompt_token_ids
    lp_whole = torch.tensor([d[t].logprob for d, t in zip(whole.prompt_logprobs[1:], ids[1:])])
    lp_chunked = torch.tensor([d[t].logprob for d, t in zip(chunked.prompt_logprobs[1:], ids[1:])])
    # fp32, chunk boundaries only reorder sums (as for text prompts)
    torch.testing.assert_close(lp_chunked, lp_whole, atol=1e-4, rtol=0)


def test_prefix_cache_hits_only_with_the_same_media(model, vision):
    llm = make_llm(model, vision, enable_prefix_caching=True, snapshot_interval=1)
    same, other = chat(picture(3)), chat(picture(4))  # equal sizes: identical token ids
    first = llm.chat(same, GREEDY)[0]
    start = first.prompt_token_ids.index(PLACEHOLDER)
    assert llm.get_stats().prefix_cache_hits == 0
    again = llm.chat(same, GREEDY)[0]
    assert llm.get_stats().prefix_cache_hits == (len(first.prompt_token_ids) - 1) // BS * BS
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    hits = llm.get_stats().prefix_cache_hits
    swapped = llm.chat(other, GREEDY)[0]
    assert swapped.prompt_token_ids == first.prompt_token_ids
    assert llm.get_stats().prefix_cache_hits - hits == start // BS * BS  # only the blocks before the image
    cold = make_llm(model, vision).chat(other, GREEDY)[0]
    assert swapped.outputs[0].token_ids == cold.outputs[0].token_ids
    # the fully cached repeat never reached its image, so it was not encoded again
    assert llm.get_stats().media_items_encoded == 2


def test_preemption_recomputes_media_prompts_without_reencoding(model, vision):
    conversations = [chat(picture(5 + i), f"Question {i}?") for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    small = make_llm(model, vision, num_blocks=44, max_num_seqs=3)  # ~3 x 115 tokens do not fit 44 x 8
    outs = small.chat(conversations, params)
    stats = small.get_stats()
    assert stats.num_preemptions > 0 and stats.media_items_encoded == 3
    roomy = make_llm(model, vision, num_blocks=256)
    assert [o.outputs[0].token_ids for o in outs] == [roomy.chat(c, params)[0].outputs[0].token_ids
                                                       for c in conversations]


def test_speculative_verification_of_a_trailing_media_token(model, vision):
    """A prompt ending in its image, prefilled but for one placeholder: that token is verified with
    drafts (n-gram drafts copy the placeholder run) and must still read its media row."""
    tok = ByteTokenizer(512)
    ids = tok.encode("Describe:") + [PLACEHOLDER]
    img = picture(9)
    plain = make_llm(model, vision).generate({"prompt_token_ids": ids, "multi_modal_data": {"image": img}}, GREEDY)[0]
    engine = LLMEngine(LocalExecutor(model), EngineConfig(num_blocks=64, block_size=BS, enable_prefix_caching=False,
                                                          max_num_batched_tokens=len(plain.prompt_token_ids) - 1,
                                                          speculative=SpeculativeConfig("ngram", 3)),
                       vision_encoder=local_vision_encoder(vision))
    media = [preprocess_media("image", img, engine.multimodal.media)]
    engine.add_request("r", ids, GREEDY, media=media)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert engine.get_stats().spec_draft_tokens > 0
    assert finals[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_videos_and_vllm_style_prompts(model, vision):
    llm = make_llm(model, vision)
    frames = [picture(20 + i, size=(56, 56)) for i in range(5)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=500)
    gif = buf.getvalue()
    gif_url = "data:image/gif;base64," + base64.b64encode(gif).decode()
    as_gif = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": gif_url}},
                                           {"type": "text", "text": "What moves?"}]}]
    as_frames = [{"role": "user", "content": [{"type": "video_url",
                                               "video_url": {"url": [data_url(f) for f in frames]}},
                                              {"type": "text", "text": "What moves?"}]}]
    by_gif, by_frames = llm.chat([as_gif, as_frames], GREEDY)
    # 5 frames at 2 fps: chunks of 4 + 1 frames, 2 x 2 tokens each
    assert by_gif.prompt_token_ids.count(PLACEHOLDER) == by_frames.prompt_token_ids.count(PLACEHOLDER) == 8
    assert len(by_gif.outputs[0].token_ids) == len(by_frames.outputs[0].token_ids) == GREEDY.max_tokens
    prompt = "<|media_start|>video<|media_content|><|kimi_image_placeholder|><|media_end|>\nWhat moves?"
    vllm_style = llm.generate({"prompt": prompt, "multi_modal_data": {"video": [gif]}}, GREEDY)[0]
    assert vllm_style.prompt == prompt and vllm_style.prompt_token_ids.count(PLACEHOLDER) == 8
    image = chat(picture(30))
    by_chat = llm.chat(image, GREEDY)[0]
    ids = ByteTokenizer(512).encode_chat(image)
    by_ids = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [picture(30)]}}, GREEDY)[0]
    assert by_ids.outputs[0].token_ids == by_chat.outputs[0].token_ids


def test_bad_media_requests_are_refused(model, vision):
    llm = make_llm(model, vision)
    ids = [72, 105, PLACEHOLDER]
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [picture(0), picture(1)]}})
    with pytest.raises(ValueError, match="ambiguous"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": picture(0), "video": [b"x"]}})
    with pytest.raises(ValueError, match="cannot decode"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b"not an image"}})
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    with pytest.raises(MediaInputError, match="remote image_url URLs are not supported") as err:
        llm.chat(remote)
    assert err.value.param == "messages[0].content[0]"
    text_only = LLM(model, ByteTokenizer(512), num_blocks=16, block_size=BS)
    with pytest.raises(ValueError, match="no vision encoder"):
        text_only.chat(chat(picture(0)))
    with pytest.raises(ValueError, match="no vision encoder"):
        text_only.engine.add_request("x", ids, media=[preprocess_media("image", picture(0), llm.engine.multimodal.media)])
    assert not llm.engine.has_unfinished_requests() and not text_only.engine.has_unfinished_requests()
