"""The same image gives identical embeddings in process and through the VisionEncoder actor."""

import io

import pytest
import ray
import torch
from PIL import Image

from k3ray.actors.pipeline.vision_encoder import RemoteVisionEncoder, VisionEncoder
from k3ray.vision import MediaConfig, encode_media, load_vision, pack_media, preprocess_media
from k3ray.weights import load_model

pytestmark = pytest.mark.timeout(300)


def png(color, size=(60, 45)) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", size, color)
    img.putpixel((3, 4), (255, 255, 255))
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_actor_embeddings_equal_in_process(ray_cluster, tiny_checkpoint):
    config = load_model(tiny_checkpoint).config
    media_cfg = MediaConfig.for_vision(config.vision)
    items = [preprocess_media("image", png(c), media_cfg) for c in ((200, 10, 10), (10, 200, 30))]
    pixels, grids = pack_media(items)
    local = encode_media(load_vision(tiny_checkpoint), pixels, grids)
    actor = ray.remote(VisionEncoder).options(num_cpus=0.5).remote(tiny_checkpoint)
    try:
        remote = RemoteVisionEncoder(actor)(pixels, grids)
    finally:
        ray.kill(actor)
    assert remote.shape == (sum(m.num_tokens for m in items), config.hidden_size)
    assert torch.equal(remote, local)
