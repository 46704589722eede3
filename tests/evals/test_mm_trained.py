"""k3-tiny-vl in process (`k3ray eval mm --model k3-tiny-vl`'s engine): the code card among 1, 2, 4 and
8 images and on one of 8 or 16 video frames (as image parts and as an animated GIF) is read at the
issue's 0.9 (exact match, seed 0); and each media bug the issue names, put into the engine, drops the
score below 0.5: the image tokens shifted by one position, the patch merge transposed, another
request's image. (Two frames swapped cannot change the answer this eval asks for, the code on
whichever frame holds it: tests/k3ray/test_vision_video.py holds frame order.)"""

import pytest
import torch

import k3ray.engine.executor as executor_module
import k3ray.engine.llm_engine as llm_engine_module
import k3ray.vision.model as vision_model_module
from k3ray.engine import LLM
from k3ray.evals.engine_target import EngineTarget

pytestmark = pytest.mark.timeout(900)
# each mutation runs this smaller grid (2 samples a depth) on a fresh engine (no prefix cache from a sound run)
MUTATION_GRID = {"image_niah": {4: 0.5}, "video_niah": {8: 0.5}, "video_niah_gif": {8: 0.5}}


def test_the_shipped_model_reads_the_card_in_images_and_videos(plain_mm, mm_floors):
    low = {cell: score for cell, score in plain_mm.scores.items() if score < mm_floors[cell[0]][cell[1]]}
    assert not low, plain_mm.scores
    assert set(plain_mm.scores) == {(task, n) for task, lengths in mm_floors.items() for n in lengths}


def shifted_splice(splice):
    """Every media embedding lands one position later (the last one past the chunk is dropped)."""
    def mutated(text_embeds, positions, media_embeds):
        keep = positions + 1 < text_embeds.shape[0]
        return splice(text_embeds, positions[keep] + 1, media_embeds[keep])
    return mutated


def transposed_merger(x, grid, kernel):
    """sd2_tpool with the patch grid read transposed (columns for rows, inside each block too)."""
    kh, kw = kernel
    dim, out, offset = x.shape[-1], [], 0
    for t, h, w in grid:
        chunk = x[offset : offset + t * h * w].view(t, h // kh, kh, w // kw, kw, dim)
        out.append(chunk.permute(0, 3, 1, 4, 2, 5).mean(dim=0).reshape(-1, kh * kw * dim))
        offset += t * h * w
    return torch.cat(out)


def stale_encoder(encode_pending):
    """Each request gets the embeddings of the last request encoded before it with as many media tokens."""
    last: dict[int, torch.Tensor] = {}

    def mutated(encoder, pending, hidden_size):
        encode_pending(encoder, pending, hidden_size)
        for media in pending:
            own = media.embeds
            if media.num_tokens in last:
                media.set_embeds(last[media.num_tokens])
            last[media.num_tokens] = own
    return mutated


MUTATIONS = {
    "image tokens shifted by one": (executor_module, "splice_media_embeddings",
                                    shifted_splice(executor_module.splice_media_embeddings)),
    "patch merge transposed": (vision_model_module, "tpool_patch_merger", transposed_merger),
    "another request's image": (llm_engine_module, "encode_pending", stale_encoder(llm_engine_module.encode_pending)),
}


@pytest.mark.parametrize("bug", list(MUTATIONS))
def test_each_media_bug_drops_the_score_below_one_half(bug, vl_checkpoint, vl_engine, plain_mm, mm_grid, monkeypatch,
                                                      tmp_path):
    assert all(plain_mm.scores[(task, n)] >= 0.9 for task, lengths in MUTATION_GRID.items() for n in lengths)
    module, name, mutated = MUTATIONS[bug]
    monkeypatch.setattr(module, name, mutated)
    broken = mm_grid(EngineTarget(LLM(vl_checkpoint, **vl_engine)), tmp_path, MUTATION_GRID, samples=2)
    assert all(score < 0.5 for score in broken.scores.values()), (bug, broken.scores)
