"""Vocabulary for synthetic tasks: adjective-noun needle keys, real and made-up words, codes.

Every draw takes an explicit `random.Random`, so a task item is a pure function of its seed.
"""

from __future__ import annotations

import random
import uuid

ADJECTIVES = tuple(
    """
    able acid aged airy amber ample angry arctic ashen autumn awake bald bitter black bland blind
    blue bold brave breezy brief bright brisk broad bronze brown busy calm candid careful cheap
    chilly civil clean clear clever cloudy coarse cold cool crooked cosy crisp cruel curly damp
    dark dear deep dense dizzy dry dull dusty eager early easy empty equal faint fair false fancy
    fast fierce fine firm flat fond frail free fresh frosty full gentle giant glad golden grand
    green grey gritty hairy happy hard harsh hasty hazy heavy hidden hollow honest huge humble icy
    idle jolly keen kind large late lazy lean level light little lively lonely long loose loud
    lucky mellow merry mild misty modern moist narrow neat nervous noble noisy odd old pale plain
    polite proud purple quick quiet rapid rare raw ready red rich rigid ripe rough round royal
    rusty sacred salty sandy sharp shiny short shy silent silver simple sleek slim slow small
    smooth snowy soft solid sour spare stale steady steep sticky stiff stormy strict strong sunny
    sweet swift tall tame tender thick thin tidy tiny tired tough vast vivid warm wary weak wet
    whole wide wild windy wise witty yellow young zesty
    """.split()
)

NOUNS = tuple(
    """
    acorn anchor anvil apple apron arrow attic badge bakery ballot banjo barrel basket beacon
    beetle bell bench berry blanket bottle boulder bracelet branch bridge bucket buckle button
    cabin cactus camel candle canoe canyon carpet castle cellar chapel cherry chimney circus clock
    cloud clover comet compass copper cottage cradle crater crayon cricket crown cupboard curtain
    cushion dagger daisy desert diamond dolphin donkey dragon drum eagle easel elbow falcon feather
    fence ferry fiddle forest fossil fountain garden garlic gate glacier glove goblet harbor harp
    helmet hammock hedge hatchet honey hornet island jacket jigsaw kettle kitten ladder lagoon
    lantern lemon lighthouse lizard locket magnet mango marble meadow mirror mitten monkey mountain
    mushroom needle nest oasis olive orchard otter oven paddle palace parrot pebble pencil pepper
    piano pillow pine planet plough pocket pond puddle pumpkin puppet quarry quill rabbit radish
    raft ribbon river rocket saddle sail satchel scarf scroll shovel skillet sled sparrow spider
    spoon squirrel stable staircase statue stove sunflower swamp sword teapot temple thimble
    thistle thunder tiger timber toaster tortoise tower trumpet tulip tunnel turnip umbrella
    valley vase velvet violin volcano wagon walnut wardrobe whistle willow window wizard yacht
    zebra
    """.split()
)
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def word_keys(rng: random.Random, count: int, exclude: frozenset[str] = frozenset()) -> list[str]:
    """`count` distinct adjective-noun keys such as `brave-lantern`, none of them in `exclude`."""
    capacity = len(ADJECTIVES) * len(NOUNS) - len(exclude)
    if count > capacity:
        raise ValueError(f"asked for {count} distinct word keys, only {capacity} exist")
    keys: list[str] = []
    seen = set(exclude)
    while len(keys) < count:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in seen:
            seen.add(key)
            keys.append(key)
    return keys


def uuids(rng: random.Random, count: int) -> list[str]:
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


def magic_numbers(rng: random.Random, count: int) -> list[str]:
    """Distinct 7-digit numbers, as RULER's needles use."""
    return [str(n) for n in rng.sample(range(1_000_000, 10_000_000), count)]


def made_up_word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def distinct_words(rng: random.Random, count: int) -> list[str]:
    """Real words (adjectives and nouns, shuffled) first, then made-up three-syllable words."""
    pool = sorted(ADJECTIVES + NOUNS)
    rng.shuffle(pool)
    words = pool[:count]
    seen = set(words)
    while len(words) < count:
        word = made_up_word(rng, 3)
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def coded_words(rng: random.Random, count: int, length: int = 5) -> list[str]:
    """Distinct random lowercase strings, RULER's 'coded words'."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        word = "".join(rng.choice(_LETTERS) for _ in range(length))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def variable_names(rng: random.Random, count: int) -> list[str]:
    """Distinct five-letter upper-case names for variable tracking."""
    return [w.upper() for w in coded_words(rng, count)]
