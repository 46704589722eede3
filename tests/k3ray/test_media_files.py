"""file:// image and video URLs (vLLM's --allowed-local-media-path): read only under the allowed
folder, symlinks resolved, and then exactly the data: URL of the same bytes; refused with a
message naming the problem otherwise."""

import base64
import io
import os
import random

import pytest
from PIL import Image

from k3ray.engine import LLM, SamplingParams
from k3ray.engine.config import MultiModalConfig
from k3ray.engine.media.inputs import MediaInputError, media_from_messages
from k3ray.evals.tasks import images
from k3ray.vision import MediaConfig

PARAMS = SamplingParams(temperature=0.0, max_tokens=6)


def png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    images.with_card(images.scene(random.Random(seed)), "123456").save(buf, format="PNG")
    return buf.getvalue()


def chat(*urls) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "Read the card."}, *parts]}]


@pytest.fixture()
def folder(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "card.png").write_bytes(png_bytes(0))
    (tmp_path / "outside.png").write_bytes(png_bytes(1))
    os.symlink(tmp_path / "outside.png", root / "escape.png")
    return root


def test_a_file_url_under_the_allowed_folder_is_its_data_url(tiny_checkpoint, folder):
    llm = LLM(tiny_checkpoint, max_model_len=1024, multimodal=MultiModalConfig(allowed_local_media_path=str(folder)))
    data = "data:image/png;base64," + base64.b64encode((folder / "card.png").read_bytes()).decode()
    by_file = llm.chat(chat(f"file://{folder}/card.png"), PARAMS)[0]
    by_data = llm.chat(chat(data), PARAMS)[0]
    assert by_file.outputs[0].token_ids == by_data.outputs[0].token_ids
    assert by_file.prompt_token_ids == by_data.prompt_token_ids
    frames = {"type": "video_url", "video_url": {"url": [f"file://{folder}/card.png", data]}}  # a frame list
    assert len(media_from_messages([{"role": "user", "content": [frames]}], MediaConfig(),
                                   local_root=str(folder))) == 1


@pytest.mark.parametrize("url, match", [
    ("file://{root}/escape.png", "outside the allowed local media folder"),  # a symlink out of it
    ("file://{root}/../outside.png", "outside the allowed local media folder"),
    ("file://{root}/missing.png", "could not be read"),
    ("file://host{root}/card.png", "names no host"),
])
def test_file_urls_outside_or_unreadable_are_refused_by_name(folder, url, match):
    with pytest.raises(MediaInputError, match=match) as caught:
        media_from_messages(chat(url.format(root=folder)), MediaConfig(), local_root=str(folder))
    assert caught.value.param == "messages[0].content[1]"


def test_file_urls_are_refused_without_an_allowed_folder_and_big_files_by_size(folder):
    with pytest.raises(MediaInputError, match="not allowed here.*--allowed-local-media-path"):
        media_from_messages(chat(f"file://{folder}/card.png"), MediaConfig())
    small = MediaConfig(max_input_bytes=100)
    with pytest.raises(MediaInputError, match="exceeds the limit of 100 bytes"):
        media_from_messages(chat(f"file://{folder}/card.png"), small, local_root=str(folder))
    for bad in ("relative/folder", str(folder / "card.png")):
        with pytest.raises(ValueError, match="allowed_local_media_path must be an absolute path to a folder"):
            MultiModalConfig(allowed_local_media_path=bad)
    assert Image.open(io.BytesIO((folder / "card.png").read_bytes())).size == images.SIZE
