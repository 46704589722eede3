"""The needle-attention reading: on the shipped k3-tiny-niah at 2K, the last MLA layer's head 0 is a copy
head (row j looks at the needle's digit j, nearly all its mass there, far above the haystack), which a
needle placed at the wrong position, a lost cache page or a wrong row order would break."""

import json

import pytest

from k3ray_training.needle_attention import main, needle_prompt


def test_the_prompt_carries_the_asked_needle_and_ends_with_its_answer():
    prompt = needle_prompt(2048, 50.0, 0, "4997477")
    assert prompt.text.endswith(" 4997477")
    assert prompt.text[prompt.needle_char: prompt.needle_char + 8] == "4997477."
    assert prompt.text.count("4997477") == 2
    with pytest.raises(ValueError, match="digits"):
        needle_prompt(2048, 50.0, 0, "49x")


def test_the_last_mla_layer_copies_the_needle_digit_by_digit(tmp_path):
    out = tmp_path / "reading.json"
    main(["--lengths", "2k", "--needle", "4997477", "--json", str(out)])
    (reading,) = json.loads(out.read_text())
    assert 1900 <= reading["prompt_tokens"] <= 2048
    heads = {(h["layer"], h["head"]): h for h in reading["heads"]}
    assert sorted({layer for layer, _ in heads}) == [4, 8, 9]  # k3-tiny-niah's MLA layers
    copy = heads[(9, 0)]
    assert copy["looks_at"] == list(range(7))
    assert min(copy["needle_mass"]) > 0.99
    # nats above the best haystack key: measured 6.6-29.5 (the previous checkpoint 18-27); 4 leaves the needle's
    # digit over 50 times any haystack key's weight, and a misplaced needle or page goes negative
    assert min(copy["gap"]) > 4
