"""Pillow renderings for multimodal needles, and the exact reader that checks them.

Haystack images are coloured shapes on a flat ground (no text, no pure white or black). The
needle is a white card with a black border and a digit code drawn without anti-aliasing in
Pillow's bundled font, one digit per fixed-width slot, so `read_code` can read it back exactly
by matching each slot against the rendered digit glyphs.
"""

from __future__ import annotations

import base64
import functools
import io
import random

from PIL import Image, ImageChops, ImageDraw, ImageFont, ImageSequence

SIZE = (160, 160)
# x0, y0, x1, y1 of the card, border included. The image pads to 168 px, a 6 x 6 grid of K3's 28 px
# merged tokens: the digits sit inside one token row (y 56-84), digit i inside token column i
CARD = (1, 42, 159, 98)
_BORDER = 2
_TEXT_X, _TEXT_Y, _PITCH = 10, 51, 26
CODE_LENGTH = 6
_FONT_SIZE = 28
WHITE, BLACK = (255, 255, 255), (0, 0, 0)


@functools.lru_cache(maxsize=1)
def _font() -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=_FONT_SIZE)


def _colour(rng: random.Random) -> tuple[int, int, int]:
    # never pure white or black, which only the card uses
    return tuple(rng.randrange(40, 216) for _ in range(3))


def scene(rng: random.Random, shapes: int = 4) -> Image.Image:
    img = Image.new("RGB", SIZE, _colour(rng))
    draw = ImageDraw.Draw(img)
    for _ in range(shapes):
        x0, y0 = rng.randrange(0, SIZE[0] - 20), rng.randrange(0, SIZE[1] - 20)
        box = (x0, y0, x0 + rng.randrange(12, 60), y0 + rng.randrange(12, 60))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=_colour(rng))
    return img


def moving_frames(rng: random.Random, count: int) -> list[Image.Image]:
    """Frames of a ball crossing a still scene: few colours, every frame different."""
    still = scene(rng, shapes=3)
    ball = _colour(rng)
    frames = []
    for i in range(count):
        frame = still.copy()
        x = 8 + (SIZE[0] - 40) * i // max(count - 1, 1)
        ImageDraw.Draw(frame).ellipse((x, 16 + i % 8, x + 24, 40 + i % 8), fill=ball)
        frames.append(frame)
    return frames


def with_card(img: Image.Image, code: str) -> Image.Image:
    if not (len(code) == CODE_LENGTH and code.isdigit()):
        raise ValueError(f"code must be {CODE_LENGTH} digits, got {code!r}")
    out = img.copy()
    draw = ImageDraw.Draw(out)
    draw.fontmode = "1"
    draw.rectangle(CARD, fill=WHITE, outline=BLACK, width=_BORDER)
    for i, digit in enumerate(code):
        draw.text((_TEXT_X + i * _PITCH, _TEXT_Y), digit, font=_font(), fill=BLACK)
    return out


def _slot_box(i: int) -> tuple[int, int, int, int]:
    x = _TEXT_X + i * _PITCH
    return (x, CARD[1] + _BORDER, min(x + _PITCH, CARD[2] - _BORDER), CARD[3] - _BORDER)


def _ink(img: Image.Image) -> bytes | None:
    """The black pixels of a white slot, cropped to their bounding box, as bytes."""
    inverted = ImageChops.invert(img.convert("L"))
    box = inverted.getbbox()
    return None if box is None else repr(box).encode() + inverted.crop(box).tobytes()


@functools.lru_cache(maxsize=1)
def _glyphs() -> dict[bytes, str]:
    x0, y0, x1, y1 = _slot_box(0)
    glyphs = {}
    for digit in "0123456789":
        slot = Image.new("RGB", (x1 - x0, y1 - y0), WHITE)
        draw = ImageDraw.Draw(slot)
        draw.fontmode = "1"
        draw.text((0, _TEXT_Y - y0), digit, font=_font(), fill=BLACK)
        glyphs[_ink(slot)] = digit
    assert len(glyphs) == 10, "two digits render alike"
    return glyphs


def read_code(img: Image.Image) -> str | None:
    """The code on the card, or None when the image has no intact card."""
    img = img.convert("RGB")
    if img.size != SIZE:
        return None
    inner = img.crop((CARD[0] + _BORDER, CARD[1] + _BORDER, CARD[2] - _BORDER, CARD[3] - _BORDER))
    colours = inner.getcolors(maxcolors=2)
    if colours is None or not {c for _, c in colours} <= {WHITE, BLACK}:
        return None
    digits = [_glyphs().get(_ink(img.crop(_slot_box(i)))) for i in range(CODE_LENGTH)]
    return None if None in digits else "".join(digits)


def png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def gif_data_url(frames: list[Image.Image], frame_ms: int = 500) -> str:
    # 500 ms per frame = K3's 2 fps video sampling, so the model sees every frame (and the needle)
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=frame_ms, loop=0)
    return "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()


def decode_data_url(url: str) -> list[Image.Image]:
    """Every frame of a base64 data: URL image (one for a PNG, all of an animated GIF)."""
    if not url.startswith("data:") or ";base64," not in url:
        raise ValueError(f"expected a base64 data: URL, got {url[:40]!r}")
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    return [frame.convert("RGB") for frame in ImageSequence.Iterator(img)]
