"""Media placeholders: exact token counts per item, expanding a chat prompt's single placeholder per
item to that many, splicing the encoder output into the text embeddings, and the tiny K3 text model
consuming the spliced embeddings."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3ray.config import k3_tiny_config
from k3ray.models.forward_batch import ForwardBatch, ModelCache
from k3ray.models.init import build_model
from k3ray.testing import assert_close, rel_rmse
from k3ray.tokenizer import ByteTokenizer, collect_media
from k3ray.vision import (
    MediaConfig,
    build_vision_model,
    encode_media,
    expand_placeholders,
    media_token_count,
    pack_media,
    preprocess_media,
    splice_media_embeddings,
)

CONFIG = k3_tiny_config()
PLACEHOLDER = CONFIG.media_placeholder_token_id


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")
    return buf.getvalue()


def _gif(frames: int, width: int, height: int, duration_ms: int = 500) -> bytes:
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, "GIF", save_all=True, append_images=images[1:], duration=duration_ms, loop=0)
    return buf.getvalue()


def test_media_token_count():
    assert media_token_count([[1, 8, 12]]) == 4 * 6
    assert media_token_count([[4, 6, 4], [4, 6, 4], [1, 6, 4]]) == 3 * 3 * 2  # frames pool: t does not count
    assert media_token_count(torch.tensor([2, 4, 4])) == 4
    with pytest.raises(ValueError, match="not a valid chunk"):
        media_token_count([[1, 3, 4]])


def test_expand_placeholders_positions_and_spans():
    ids = [5, PLACEHOLDER, 6, 7, PLACEHOLDER, 8]
    out = expand_placeholders(ids, PLACEHOLDER, [3, 2])
    assert out.token_ids == [5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, 6, 7, PLACEHOLDER, PLACEHOLDER, 8]
    assert out.positions.tolist() == [1, 2, 3, 6, 7] and out.positions.dtype == torch.long
    assert out.spans == ((1, 3), (6, 2))
    plain = expand_placeholders([1, 2], PLACEHOLDER, [])
    assert plain.token_ids == [1, 2] and plain.positions.numel() == 0 and plain.spans == ()


@pytest.mark.parametrize(
    "ids, counts, match",
    [
        ([1, PLACEHOLDER, 2], [3, 4], "1 media placeholder token.* but 2 media item"),
        ([1, 2], [3], "0 media placeholder"),
        ([PLACEHOLDER], [0], "positive ints"),
        ([PLACEHOLDER], [2.0], "positive ints"),
    ],
)
def test_expand_placeholders_errors(ids, counts, match):
    with pytest.raises(ValueError, match=match):
        expand_placeholders(ids, PLACEHOLDER, counts)


def test_chat_prompt_expands_to_exact_counts():
    media = MediaConfig.for_vision(CONFIG.vision, max_patches=64, video_max_patches_per_frame=16)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a"}},
        {"type": "text", "text": "and"},
        {"type": "video_url", "video_url": {"url": "b"}},
    ]}]
    ids = ByteTokenizer(vocab_size=CONFIG.vocab_size).encode_chat(messages)
    kinds = [item.kind for item in collect_media(messages)]
    items = [preprocess_media("image", _png(150, 100), media), preprocess_media("video", _gif(9, 60, 40), media)]
    assert kinds == ["image", "video"]
    expanded = expand_placeholders(ids, PLACEHOLDER, [m.num_tokens for m in items])
    assert items[0].num_tokens == 4 * 6  # 150x100 -> 143x95 under 64 patches -> padded 168x112 -> 12x8 patches
    # 9 frames of 500 ms sampled at 2 fps: all 9, in chunks of 4, 4, 1; 60x40 padded to 84x56 = 6x4 patches
    assert items[1].grid_thws.tolist() == [[4, 4, 6], [4, 4, 6], [1, 4, 6]] and items[1].num_tokens == 3 * 2 * 3
    assert expanded.token_ids.count(PLACEHOLDER) == sum(m.num_tokens for m in items)
    assert len(expanded.token_ids) == len(ids) - 2 + sum(m.num_tokens for m in items)
    model = build_vision_model(CONFIG.vision, torch.float32, seed=0)
    embeds = encode_media(model, *pack_media(items))
    assert embeds.shape == (expanded.positions.numel(), CONFIG.hidden_size)


def test_splice_replaces_only_placeholder_rows():
    text = torch.randn(9, 4)
    positions = torch.tensor([1, 2, 6])
    media = torch.randn(3, 4, dtype=torch.float64)
    out = splice_media_embeddings(text, positions, media)
    assert out.dtype == text.dtype and torch.equal(out[positions], media.float())
    keep = torch.tensor([0, 3, 4, 5, 7, 8])
    assert torch.equal(out[keep], text[keep]) and not torch.equal(out, text)


@pytest.mark.parametrize(
    "positions, media, match",
    [
        (torch.tensor([1, 2]), torch.randn(3, 4), "2 placeholder positions but 3 media embeddings"),
        (torch.tensor([1, 2, 3]), torch.randn(3, 5), "width 5 != text hidden size 4"),
        (torch.tensor([1, 2, 9]), torch.randn(3, 4), r"in \[0, 9\)"),
        (torch.tensor([1, 1, 2]), torch.randn(3, 4), "distinct"),
        (torch.tensor([[1, 2, 3]]), torch.randn(3, 4), "expected text_embeds"),
    ],
)
def test_splice_errors(positions, media, match):
    with pytest.raises(ValueError, match=match):
        splice_media_embeddings(torch.randn(9, 4), positions, media)


def test_text_model_reads_the_spliced_embeddings():
    text_model = build_model(CONFIG, torch.float32, seed=0)
    vision = build_vision_model(CONFIG.vision, torch.float32, seed=0)
    item = preprocess_media("image", _png(40, 30), MediaConfig.for_vision(CONFIG.vision))
    expanded = expand_placeholders([1, 2, PLACEHOLDER, 3], PLACEHOLDER, [item.num_tokens])
    ids = torch.tensor(expanded.token_ids)
    T = len(ids)
    media = encode_media(vision, item.pixel_values, item.grid_thws)
    embeds = splice_media_embeddings(text_model.embed(ids), expanded.positions, media)

    def logits(inputs_embeds):
        cache = ModelCache.allocate(CONFIG, num_state_slots=1, num_blocks=1, block_size=16, dtype=torch.float32)
        batch = ForwardBatch(torch.tensor([0, T]), torch.tensor([T]), torch.tensor([0]), torch.tensor([[0]]), cache)
        with torch.no_grad():
            return text_model(ids, batch, inputs_embeds=inputs_embeds)

    with_media, plain = logits(embeds), logits(None)
    first = expanded.positions[0]
    # causal: rows before the media only see the same tokens (fp32 chunked kernels may round differently)
    assert_close("before the media", plain[:first], with_media[:first], 1e-5)
    assert rel_rmse(plain[first:], with_media[first:]) > 0.05
