"""Code cards for training the vision-language fixture: the eval's card (`evals.tasks.images`) and
varied ones (font, size, ink and card colour, position), each with where its digits fall in the
image's merged tokens, so a training step can tell the tower which token should carry which digit.

A 160 x 160 image pads to 168 x 168: 12 x 12 patches of 14 px, merged 2 x 2 into a 6 x 6 grid of
28 px tokens. The card's six digits map to the six tokens of the row holding the digits' centre,
digit j to column j: on the eval's card each digit lies inside its token; a varied card moves a few
pixels off it.
"""

from __future__ import annotations

import functools
import glob
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from k3ray.evals.tasks import images, multimodal

TOKEN_PX = 28  # patch 14 x merge 2
GRID_SIDE = 6  # tokens per side of a padded 168 x 168 image
DEJAVU = "/usr/share/fonts/truetype/dejavu/DejaVu{}.ttf"
# the faces varied cards use where installed (the eval's card is always Pillow's bundled font)
FACES = ("Sans", "Sans-Bold", "SansMono", "SansMono-Bold", "Serif", "Serif-Bold", "SansCondensed")
EDGE_PX = 4


@dataclass(frozen=True)
class Card:
    image: Image.Image
    code: str
    tokens: tuple[int, ...]  # [6] the merged-token index (raster order) meant to carry each digit


def installed_faces() -> tuple[str, ...]:
    return tuple(face for face in FACES if glob.glob(DEJAVU.format(face)))


@functools.lru_cache(maxsize=64)
def _font(face: str | None, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size) if face is None else ImageFont.truetype(DEJAVU.format(face), size)


def _row_tokens(centre_y: float) -> tuple[int, ...]:
    row = min(GRID_SIDE - 1, int(centre_y // TOKEN_PX))
    return tuple(row * GRID_SIDE + j for j in range(images.CODE_LENGTH))


def eval_card(img: Image.Image, code: str) -> Card:
    """The eval's card (images.with_card) and its digits' tokens."""
    top, bottom = _font(None, 28).getbbox("0")[1::2]
    return Card(images.with_card(img, code), code, _row_tokens(images._TEXT_Y + (top + bottom) / 2))


def varied_card(img: Image.Image, code: str, rng: random.Random, faces: tuple[str, ...]) -> Card:
    """A card in a random face and size, off-white card and dark ink, moved up or down and a few
    pixels sideways; still six 20 px digit slots across the card's width."""
    face = rng.choice((None, *faces))
    font = _font(face, rng.randrange(22, 31))
    x0, y0, x1, y1 = images.CARD
    top, bottom = font.getbbox("0")[1::2]
    while True:  # the digits' centre at least EDGE_PX inside a token row, so their row is unambiguous
        dx, dy = rng.randrange(-4, 5), rng.randrange(-44, 51)
        text_y = y0 + dy + (y1 - y0 - (top + bottom)) / 2  # digits centred in the card
        if EDGE_PX <= (text_y + (top + bottom) / 2) % TOKEN_PX <= TOKEN_PX - EDGE_PX:
            break
    paper = tuple(rng.randrange(225, 256) for _ in range(3))
    ink = tuple(rng.randrange(0, 70) for _ in range(3))
    out = img.copy()
    draw = ImageDraw.Draw(out)
    draw.fontmode = rng.choice(("1", "L"))
    draw.rectangle((x0 + dx, y0 + dy, x1 + dx, y1 + dy), fill=paper, outline=ink, width=rng.choice((1, 2, 3)))
    for i, digit in enumerate(code):
        width = font.getlength(digit)
        draw.text((images._TEXT_X + dx + i * images._PITCH + (images._PITCH - width) / 2, text_y), digit,
                  font=font, fill=ink)
    return Card(out, code, _row_tokens(text_y + (top + bottom) / 2))


def training_card(img: Image.Image, rng: random.Random, faces: tuple[str, ...], varied_share: float,
                  code: str | None = None) -> Card:
    """`code` (None: a random one) on the eval's card, or with probability `varied_share` on a varied one."""
    if code is None:
        code = multimodal.random_code(rng)
    if varied_share and rng.random() < varied_share:
        return varied_card(img, code, rng, faces)
    return eval_card(img, code)
