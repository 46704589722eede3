"""Images and videos through the live Serve app on loopback, driven by the official `openai`
client: greedy answers equal `LLM.chat` on the same checkpoint (no server), and every bad media
input is a 400 with an OpenAI error body. A model without a vision tower refuses media (in-process
app, no Ray)."""

import base64
import io
import struct
import zlib

import httpx
import openai
import pytest
import torch
from PIL import Image

from k3ray.engine import LLM

pytestmark = pytest.mark.timeout(600)
MODEL = "k3-vision"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 12
MAX_REQUEST_PIXELS = 2**26  # decoded pixels per request: two 5000 x 5000 frames, not three



def picture(seed: int, size=(84, 112)) -> Image.Image:
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def gif(frames: list[Image.Image]) -> bytes:
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=500)
    return buf.getvalue()


def huge_png_header() -> bytes:
    """A PNG whose header claims 100000 x 100000 pixels: refused before any pixel is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


@pytest.fixture(scope="module")
def server(serve_app, k2_tiny_checkpoint):
    return serve_app(
        {"model": {"model": k2_tiny_checkpoint}, "server": {"served_model_name": MODEL},
         "engine": {"max_model_len": MAX_MODEL_LEN, "cache_memory_mb": 16, "max_num_seqs": 8},
         "media": {"max_request_pixels": MAX_REQUEST_PIXELS}}
    )


@pytest.fixture(scope="module")
def pipeline_url(server, k2_tiny_checkpoint):
    """A second app on the same Serve instance: a 2-stage pipeline whose replica runs the tower as
    its VisionEncoder actor (in the replica's placement group)."""
    from k3ray.actors.serve import launch as serve_launch

    url = serve_launch.deploy(
        {"model": {"model": k2_tiny_checkpoint}, "server": {"served_model_name": MODEL},
         "engine": {"max_model_len": MAX_MODEL_LEN, "cache_memory_mb": 16, "max_num_seqs": 4},
         "parallel": {"pipeline": 2, "replica_cpus": 0.5, "stage_cpus": 0.5, "shard_cpus": 0.5, "router_cpus": 0.25}},
        port=int(server.rsplit(":", 1)[1]), name="k3ray-pipeline", route_prefix="/pipeline", proxy_location="HeadOnly",
    )
    yield url
    from ray import serve

    serve.delete("k3ray-pipeline")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llm(k2_tiny_checkpoint):
    return LLM(k2_tiny_checkpoint, num_blocks=256, block_size=16)


def reference(llm: LLM, messages: list[dict]):
    from k3ray.engine import SamplingParams

    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_image_chat_equals_the_engine(client, http, llm):
    messages = user(text_part("Look at these."), image_part(data_url(png(picture(0)))),
                    image_part(data_url(png(picture(1, size=(56, 84))))), text_part("What differs?"))
    ref = reference(llm, messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert tokenized["tokens"] == ref.prompt_token_ids


def test_image_chat_on_a_ray_pipeline_replica_equals_the_engine(pipeline_url, llm):
    pipeline = openai.OpenAI(base_url=f"{pipeline_url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = user(image_part(data_url(png(picture(3)))), text_part("Describe it."))
    ref = reference(llm, messages)
    r = pipeline.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_video_as_an_animated_gif_or_a_frame_list(client, llm):
    frames = [picture(10 + i, size=(56, 56)) for i in range(5)]
    for video in (data_url(gif(frames), "image/gif"), [data_url(png(f)) for f in frames]):
        messages = user({"type": "video_url", "video_url": {"url": video}}, text_part("What moves?"))
        ref = reference(llm, messages)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].message.content == ref.outputs[0].text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


@pytest.mark.parametrize("part, words", [
    (image_part("https://example.com/cat.png"), ["remote image_url URLs are not supported", "data: URL"]),
    (image_part("file:///etc/passwd"), ["(file:// URLs) are not allowed here", "data:", "--allowed-local-media-path"]),
    (image_part("data:image/png;base64,%%%not-base64%%%"), ["not valid base64"]),
    (image_part(data_url(b"definitely not an image")), ["could not be read", "cannot decode"]),
    (image_part(data_url(huge_png_header())), ["pixels"]),
    ({"type": "image_url", "image_url": {"detail": "high"}}, ["needs a 'url'"]),
    (image_part(["data:,"]), ["must be one URL"]),
    ({"type": "video_url", "video_url": {"url": []}}, ["frame list is empty"]),
    ({"type": "video_url", "video_url": {"url": data_url(b"GIF89a-broken", "image/gif")}}, ["video_url could not be read"]),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, ["input_audio", "not supported"]),
])
def test_bad_media_is_a_400(http, part, words):
    messages = user(text_part("look"), part)
    body = error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}))
    assert body["param"] == "messages[0].content[1]"
    for word in words:
        assert word in body["message"], body["message"]


def test_too_long_with_its_image_is_a_context_error(http):
    big = picture(2, size=(700, 700))  # 25 x 25 patches -> 13 x 13 = 169 tokens each
    messages = user(*[image_part(data_url(png(big)))] * 6, text_part("?"))
    body = error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}))
    assert body["code"] == "context_length_exceeded"


def test_a_frame_list_over_the_pixel_budget_is_a_400_and_memory_stays_flat(http, k3server_replicas):
    """Four 5000 x 5000 frames (each under the per-image limit, tiny as PNGs): the third would pass
    the request's pixel budget, so it is refused before it is decoded, and the replica holds at most
    one decoded frame at a time (all four at once took ~300 MB here before)."""
    frame = png(Image.new("RGB", (5000, 5000), (40, 90, 160)))
    video = {"type": "video_url", "video_url": {"url": [data_url(frame)] * 4}}
    (replica,) = k3server_replicas()

    def replica_rss_mb() -> float:
        return replica.memory_info().rss / 2**20

    before = replica_rss_mb()
    for _ in range(2):
        messages = user(text_part("?"), video)
        body = error_of(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}))
        assert body["param"] == "messages[0].content[1]" and str(MAX_REQUEST_PIXELS) in body["message"]
    grown = replica_rss_mb() - before
    print(f"replica RSS {before:.0f} MB before, {grown:+.0f} MB after two refused 4-frame videos")
    assert grown < 150, grown


def in_process_app(checkpoint: str, **engine_kw):
    """The OpenAI app over an in-process engine (no Ray, no Serve)."""
    from fastapi.testclient import TestClient

    from k3ray.actors.openai.routes import build_openai_app
    from k3ray.actors.openai.serving import OpenAIServing
    from k3ray.engine import AsyncEngine, EngineConfig, LLMEngine, LocalExecutor
    from k3ray.tokenizer import load_tokenizer
    from k3ray.weights import load_model

    tok = load_tokenizer(checkpoint)
    engine = LLMEngine(LocalExecutor(load_model(checkpoint)), EngineConfig(num_blocks=64, block_size=16), tok,
                       **engine_kw)
    return TestClient(build_openai_app(OpenAIServing(AsyncEngine(engine), tok, MODEL)))


def test_remote_media_urls_when_the_engine_allows_them(k2_tiny_checkpoint):
    """A loopback HTTP server holds the image: the answer equals the same image sent inline."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from k3ray.engine.media.prompt_media import local_vision_encoder
    from k3ray.engine.config import MultiModalConfig
    from k3ray.vision import MediaConfig, load_vision

    image = png(picture(4))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Length", str(len(image) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(image)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{httpd.server_address[1]}"
    vision = load_vision(k2_tiny_checkpoint)
    media = MediaConfig.for_vision(vision.config, max_input_bytes=len(image) + 10)
    try:
        with in_process_app(k2_tiny_checkpoint, vision_encoder=local_vision_encoder(vision),
                            multimodal=MultiModalConfig(media, allow_remote_urls=True)) as c:
            def ask(url):
                body = {"messages": user(image_part(url), text_part("?")), "max_tokens": 6, "temperature": 0}
                return c.post("/v1/chat/completions", json=body)

            remote, inline = ask(f"{root}/cat.png"), ask(data_url(image))
            assert remote.status_code == 200, remote.text
            assert remote.json()["choices"] == inline.json()["choices"]
            assert "HTTP 404" in error_of(ask(f"{root}/missing.png"))["message"]
            oversized = data_url(png(picture(5, size=(200, 200))))
            assert "exceeds the limit" in error_of(ask(oversized))["message"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_model_without_a_vision_tower_refuses_media(k2_tiny_checkpoint):
    """In process (no Ray): the OpenAI app over an engine that has no vision encoder."""
    with in_process_app(k2_tiny_checkpoint) as c:
        for part in (image_part(data_url(png(picture(0)))), {"type": "video_url", "video_url": {"url": "data:,"}}):
            body = error_of(c.post("/v1/chat/completions", json={"messages": user(text_part("look"), part)}))
            assert body["param"] == "messages[0].content[1]" and body["code"] == "unsupported_content"
            assert "no vision tower" in body["message"]
        ok = c.post("/v1/chat/completions", json={"messages": user(text_part("hi")), "max_tokens": 2})
        assert ok.status_code == 200, ok.text
