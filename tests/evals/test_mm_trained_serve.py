"""k3-tiny-vl through the real Serve endpoint (`k3ray serve --model k3-tiny-vl`'s app on loopback):
the multimodal grid gives the in-process engine's predictions, with the tower in the replica and as
the VisionEncoder Ray actor of a 2-stage pipeline; a request whose text before its images is a
prefix-cache hit still reads its own images; and a batch mixing image, video and text-only requests
answers each as the engine answers it alone."""

import base64
import copy
import random
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from k3ray.engine import LLM
from k3ray.evals.engine_target import EngineTarget
from k3ray.evals.openai_target import OpenAITarget
from k3ray.evals.tasks import Cell, get_task, images, multimodal

pytestmark = pytest.mark.timeout(900)
ENGINE = {"max_model_len": 2048, "cache_memory_mb": 64}
PIPELINE_GRID = {"image_niah": {2: 0.9, 8: 0.9}, "video_niah": {16: 0.9}, "video_niah_gif": {8: 0.9, 16: 0.9}}
# the plain app's default share: the task lengths PIPELINE_GRID leaves out, so the two tests together serve every
# (task, length) of MM_FLOORS (each cell equal to the in-process grid, which holds every floor); `-m slow`: all
SERVED_GRID = {"image_niah": {1: 0.9, 4: 0.9}, "video_niah": {8: 0.9}}
HITS = "k3ray:prefix_cache_hits"
# a long system message: whole prefix-cache blocks of text before the first image
SYSTEM = "You read codes off cards in pictures and videos. " * 6


@pytest.fixture(scope="module")
def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(serve_app, port: int, checkpoint: str, parallel: dict, media: dict | None = None) -> OpenAITarget:
    server = {"served_model_name": checkpoint, "max_queue_wait_s": 0}  # scores, not admission (see niah's)
    return OpenAITarget(serve_app({"model": {"model": checkpoint}, "server": server, "engine": ENGINE,
                                   "parallel": parallel, "media": media or {}}, port=port), checkpoint)


def _hits(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=60).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.split("{")[0].split(" ")[0] in (HITS, HITS + "_total"))  # not a _created timestamp


def _card_chat(seed: int, count: int) -> tuple[list[dict], str]:
    rng = random.Random(seed)
    code = "".join(rng.choice("0123456789") for _ in range(6))
    pictures = [images.scene(rng) for _ in range(count)]
    index = rng.randrange(count)
    pictures[index] = images.with_card(pictures[index], code)
    return [{"role": "system", "content": SYSTEM}, *multimodal.image_messages(pictures)], code


@pytest.mark.parametrize("every", [pytest.param(False, id="share"),
                                   pytest.param(True, id="all", marks=pytest.mark.slow)])
def test_served_grid_is_the_engine_s(serve_app, port, vl_checkpoint, plain_mm, mm_grid, mm_floors, every, tmp_path):
    served = _serve(serve_app, port, vl_checkpoint, {})
    floors = mm_floors if every else SERVED_GRID
    grid = mm_grid(served, tmp_path, floors)
    assert grid.predictions == {k: v for k, v in plain_mm.predictions.items() if k in grid.predictions}
    assert len(grid.predictions) == sum(len(n) for n in floors.values()) * 3 * 4
    assert all(grid.scores[(task, n)] >= floor for task, by_length in floors.items() for n, floor in by_length.items())


def test_image_files_read_as_their_data_urls(serve_app, port, vl_checkpoint, vl_engine, tmp_path):
    """image_url parts naming files under the server's --allowed-local-media-path."""
    served = _serve(serve_app, port, vl_checkpoint, {}, {"allowed_local_media_path": str(tmp_path)})
    engine = EngineTarget(LLM(vl_checkpoint, **vl_engine))
    right = 0
    for cell in (Cell("image_niah", 4, 50.0, 0), Cell("video_niah", 8, 0.0, 1)):
        item = get_task(cell.task).build(cell, engine, seed=0)
        files = copy.deepcopy(item.prompt)
        for i, part in enumerate(p for p in files[0]["content"] if p["type"] == "image_url"):
            path = tmp_path / f"{cell.task}-{i}.png"
            path.write_bytes(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))
            part["image_url"]["url"] = f"file://{path}"
        want = engine.complete(item.prompt, item.max_tokens)
        assert served.complete(files, item.max_tokens) == want
        right += item.answers[0] in want
    assert right >= 1  # the model reads them (a broken path would answer both wrong)


def test_a_prefix_cache_hit_on_the_text_before_the_images_reads_the_new_images(serve_app, port, vl_checkpoint,
                                                                                  vl_engine):
    """Two earlier requests share the text before their images and branch there (the second writes the
    KDA snapshot at the branch point); a third resumes from that prefix and reads its own images."""
    served = _serve(serve_app, port, vl_checkpoint, {})
    chats = [_card_chat(seed, 4) for seed in (1, 2, 3)]
    (first, _), (second, _), (third, code) = chats
    assert first[:1] == third[:1] and first[1]["content"][0] == third[1]["content"][0]  # the same text first
    alone = EngineTarget(LLM(vl_checkpoint, **vl_engine)).complete(third, 16)  # a fresh engine: no cache
    served.complete(first, 16)
    served.complete(second, 16)
    before = _hits(served.root)
    assert served.complete(third, 16) == alone
    assert _hits(served.root) >= before + 384  # the 388 tokens before the first image, to the last whole block
    assert code in alone


def test_a_batch_mixing_images_videos_and_text_answers_each_as_alone(serve_app, port, vl_checkpoint, vl_engine):
    served = _serve(serve_app, port, vl_checkpoint, {})
    engine = EngineTarget(LLM(vl_checkpoint, **vl_engine))
    cells = [Cell("image_niah", 4, 50.0, 0), Cell("image_niah", 1, 0.0, 1), Cell("video_niah", 8, 100.0, 0),
             Cell("video_niah_gif", 16, 50.0, 0), Cell("video_order_gif", 8, 50.0, 0), Cell("niah", 1024, 50.0, 0),
             Cell("niah", 1024, 0.0, 1)]
    items = [get_task(c.task).build(c, engine, seed=0, chat=True) for c in cells]
    alone = [engine.complete(item.prompt, item.max_tokens) for item in items]
    with ThreadPoolExecutor(len(items)) as pool:  # all in flight together: batched in the replica's steps
        together = list(pool.map(lambda item: served.complete(item.prompt, item.max_tokens), items))
    assert together == alone
    assert sum(any(a in got for a in item.answers) for item, got in zip(items, together)) >= len(items) - 1


def test_the_vision_encoder_actor_of_a_pipeline_gives_the_engine_s_predictions(serve_app, port, vl_checkpoint,
                                                                               plain_mm, mm_grid, tmp_path):
    distributed = _serve(serve_app, port, vl_checkpoint, {"pipeline": 2})
    grid = mm_grid(distributed, tmp_path, PIPELINE_GRID)
    assert grid.predictions == {k: v for k, v in plain_mm.predictions.items() if k in grid.predictions}
    assert len(grid.predictions) == sum(len(n) for n in PIPELINE_GRID.values()) * 3 * 4
